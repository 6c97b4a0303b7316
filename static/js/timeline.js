// The live timeline (/messages/): rows come in from the event stream (static/js/stream.js)
// without ever moving under the reader.
//
// New rows are only inserted while nobody is reading: not while the operator has paused
// (button or key "p"), has scrolled the table's top out of view, holds the pointer over the
// rows or has selected text in them. Meanwhile pushed events for rows newer than the newest
// row the page knows of are counted in the "N new" bar, checked against the page's filters
// (every filter can be told from an event's fields); Resume or a click on the bar shows them.
//
// A push is a hint: after a gap in the stream (reach:stream-resync) the page re-reads the
// table, or, while held, asks the server how many rows it has not shown (new-count).
(function () {
  "use strict";
  var live = document.getElementById("messages-live");
  if (!live || !window.htmx) return;
  var body = document.body;
  var pauseButton = document.getElementById("timeline-pause");
  var bar = document.getElementById("timeline-new");
  var holdNote = document.getElementById("timeline-hold");

  // At most two refreshes a second however fast events come, and the last event of a burst
  // is never dropped (htmx's own `throttle:` discards it).
  var REFRESH_GAP_MS = 500;
  // The slow poll is only a fallback for a stream that is down or lost events.
  var POLL_OPEN_MS = 30000;
  var POLL_CLOSED_MS = 5000;
  // Past this many unseen rows the count stops being exact and says "about".
  var TRACK_MAX = 5000;

  var paused = false;
  var view = null;        // what the rendered part says: seen id, query, filters, cursor
  var pending = {};       // id -> true: newer rows that match, not shown yet
  var pendingCount = 0;
  var base = 0;           // rows counted by the server up to baseUpTo (after a gap)
  var baseUpTo = 0;
  var about = false;
  var more = false;
  var partial = false;  // the server looked at the newest rows only: its count is a floor
  var inFlight = false;
  var again = false;
  var lastPoll = Date.now();

  function readView() {
    var part = live.querySelector("[data-timeline]");
    if (!part) return null;
    var seen = parseInt(part.getAttribute("data-seen-id"), 10) || 0;
    var rows = part.querySelectorAll("tr[data-id]");
    for (var i = 0; i < rows.length; i++) {
      seen = Math.max(seen, parseInt(rows[i].getAttribute("data-id"), 10) || 0);
    }
    var filter = {};
    var script = part.querySelector("#timeline-filter");
    if (script) {
      try { filter = JSON.parse(script.textContent) || {}; } catch (e) { filter = {}; }
    }
    return {
      seen: seen,
      query: part.getAttribute("data-query") || "",
      historical: part.hasAttribute("data-before"),
      filter: filter
    };
  }

  function resetCounts() {
    pending = {};
    pendingCount = 0;
    base = 0;
    baseUpTo = view ? view.seen : 0;
    about = false;
    more = false;
    partial = false;
  }

  function readingReason() {
    var selection = window.getSelection && window.getSelection();
    if (selection && !selection.isCollapsed && selection.anchorNode &&
        live.contains(selection.anchorNode)) return "text selected";
    if (live.querySelector("tbody:hover")) return "pointer on the rows";
    var table = live.querySelector("table");
    if (table && table.getBoundingClientRect().top < 0) return "scrolled down";
    return "";
  }

  function holdReason() {
    if (paused) return "paused";
    if (view && view.historical) return "older rows";
    return readingReason();
  }

  function renderBar() {
    var reason = holdReason();
    holdNote.textContent = reason && reason !== "older rows" ? "Held: " + reason + "." : "";
    var count = base + pendingCount;
    body.dataset.timelineNew = String(count);
    if (!count && !about) {
      bar.hidden = true;
      return;
    }
    var words = (more ? "more than " : (partial ? "at least " : (about ? "about " : ""))) +
      count + " new message" +
      (count === 1 && !more ? "" : "s");
    bar.textContent = view && view.historical ?
      words + ": go to the newest" : words + ": show " + (count === 1 && !more ? "it" : "them");
    bar.hidden = false;
  }

  function listUrl() {
    return live.getAttribute("data-list-url") + (view && view.query ? "?" + view.query : "");
  }

  function refresh() {
    if (!view || holdReason()) {
      renderBar();
      return;
    }
    if (inFlight) {
      again = true;
      return;
    }
    inFlight = true;
    var done = function () {
      inFlight = false;
      if (again) {
        again = false;
        scheduleRefresh();
      }
    };
    htmx.ajax("GET", listUrl(), {source: live, target: live, swap: "innerHTML"}).then(done, done);
  }

  // Paced like every live region (static/js/pace.js).
  var scheduleRefresh = window.reachPaced(REFRESH_GAP_MS, function () { refresh(); });

  // Whether a pushed event's row is in the page's filtered set: the server's filters
  // (messages/selectors.py MessageFilter), told from the event's fields.
  function matches(ev, f) {
    if (f.statuses && f.statuses.length && f.statuses.indexOf(ev.status) < 0) return false;
    if (f.type && ev.messageType !== f.type) return false;
    if (f.direction && ev.direction !== f.direction) return false;
    if (f.agent && ev.toAgentId !== f.agent && ev.fromAgentId !== f.agent) return false;
    if (f.node && ev.targetNodeId !== f.node) return false;
    // The A2A-over-MQTT profile's rows are all on its node (f.profileNode).
    if (f.dialect === "a2a-mqtt" && ev.targetNodeId !== f.profileNode) return false;
    if (f.dialect === "native" && ev.targetNodeId === f.profileNode) return false;
    if (f.namespace) {
      // `fin.tax`, or a profile agent `acme/ops/echo` of org `acme`.
      var dotted = f.namespace + ".", slashed = f.namespace + "/";
      var to = ev.toAgentId || "", from = ev.fromAgentId || "";
      if (to.indexOf(dotted) !== 0 && from.indexOf(dotted) !== 0 &&
          to.indexOf(slashed) !== 0 && from.indexOf(slashed) !== 0) return false;
    }
    if (f.conversation && ev.conversationId !== f.conversation) return false;
    if (f.task && ev.taskId !== f.task) return false;
    if (f.q && ev.messageId !== f.q && ev.taskId !== f.q && ev.conversationId !== f.q) {
      return false;
    }
    if (f.error && (ev.error || "").toLowerCase().indexOf(f.error.toLowerCase()) < 0) {
      return false;
    }
    // A new row is stored about when its first event leaves: past `until` it is outside.
    if (f.until && ev.at && Date.parse(ev.at) >= Date.parse(f.until)) return false;
    return true;
  }

  function count(ev) {
    if (!view || typeof ev.id !== "number" || ev.id <= baseUpTo) return;
    var match = matches(ev, view.filter);
    if (match && !pending[ev.id]) {
      if (pendingCount >= TRACK_MAX) {
        about = true;
        return;
      }
      pending[ev.id] = true;
      pendingCount += 1;
    } else if (!match && pending[ev.id]) {
      // Its status moved out of the filters (SENT → PUBLISHED while showing SENT).
      delete pending[ev.id];
      pendingCount -= 1;
    }
  }

  function askServer() {
    if (!view) return;
    var url = live.getAttribute("data-new-count-url") + "?" +
      (view.query ? view.query + "&" : "") + "after=" + view.seen;
    fetch(url, {credentials: "same-origin", headers: {"Accept": "application/json"}})
      .then(function (response) { return response.ok ? response.json() : null; })
      .then(function (answer) {
        if (!answer || answer.after !== view.seen) return;
        base = answer.count;
        baseUpTo = answer.upTo;
        more = answer.more;
        partial = !!answer.partial;
        // Rows the server counted are no longer pending here.
        for (var id in pending) {
          if (Number(id) <= baseUpTo) {
            delete pending[id];
            pendingCount -= 1;
          }
        }
        about = false;
        renderBar();
      })
      .catch(function () { /* the next poll or event tries again */ });
  }

  function setPaused(value) {
    paused = value;
    pauseButton.setAttribute("aria-pressed", paused ? "true" : "false");
    pauseButton.textContent = paused ? "Resume" : "Pause";
    body.dataset.timelinePaused = paused ? "true" : "false";
    if (!paused) refresh();
    renderBar();
  }

  function holdMayHaveEnded() {
    if (!holdReason() && (base + pendingCount > 0 || about)) scheduleRefresh();
    renderBar();
  }

  view = readView();
  resetCounts();

  body.addEventListener("a2a_message", function (event) {
    var ev = event.detail || {};
    if (holdReason()) {
      count(ev);
      renderBar();
    } else {
      scheduleRefresh();
    }
  });

  body.addEventListener("reach:stream-resync", function () {
    if (holdReason()) askServer();
    else refresh();
  });

  // The bulk resend's count belongs to the filters it was counted for: new filters, new count.
  var panel = document.getElementById("bulk-resend-panel");
  var panelStart = panel ? panel.innerHTML : "";

  document.body.addEventListener("htmx:afterSwap", function (event) {
    if (event.detail.target !== live) return;
    var before = view ? view.query : null;
    view = readView();
    if (panel && view && view.query !== before) {
      panel.innerHTML = panelStart;
      htmx.process(panel);
    }
    resetCounts();
    renderBar();
  });

  pauseButton.addEventListener("click", function () { setPaused(!paused); });

  bar.addEventListener("click", function () {
    if (view && view.historical) {
      location.href = listUrl();
      return;
    }
    setPaused(false);
    window.scrollTo(0, 0);
    refresh();
  });

  document.addEventListener("keydown", function (event) {
    if (event.key !== "p" || event.ctrlKey || event.metaKey || event.altKey) return;
    var target = event.target;
    var tag = target && target.tagName;
    if (tag === "INPUT" || tag === "TEXTAREA" || tag === "SELECT" ||
        (target && target.isContentEditable)) return;
    event.preventDefault();
    setPaused(!paused);
  });

  live.addEventListener("pointerleave", holdMayHaveEnded);
  document.addEventListener("selectionchange", function () {
    if (!paused) holdMayHaveEnded();
  });
  var scrollQueued = false;
  window.addEventListener("scroll", function () {
    if (scrollQueued) return;
    scrollQueued = true;
    window.requestAnimationFrame(function () {
      scrollQueued = false;
      holdMayHaveEnded();
    });
  }, {passive: true});

  // The fallback poll: slow while the stream is open, quicker while it is not.
  setInterval(function () {
    var every = body.dataset.streamState === "open" ? POLL_OPEN_MS : POLL_CLOSED_MS;
    if (Date.now() - lastPoll < every) return;
    lastPoll = Date.now();
    if (holdReason()) askServer();
    else refresh();
  }, 1000);

  renderBar();
})();
