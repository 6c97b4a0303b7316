// The live task list (/tasks/): re-read from the server when the stream says messages
// changed (static/js/stream.js's reach:changed: at most once a second, and once after the
// last event of a burst), never while somebody is reading it: paused (button or key "p"),
// scrolled down, the pointer on the rows, text selected, or an older page. Meanwhile the
// bar counts the changes heard; Resume or a click on it shows them.
//
// A push is a hint: after a gap in the stream (reach:stream-resync) the list is re-read,
// and a slow poll covers a stream that is down.
(function () {
  "use strict";
  var live = document.getElementById("tasks-live");
  if (!live || !window.htmx) return;
  var body = document.body;
  var pauseButton = document.getElementById("tasks-pause");
  var bar = document.getElementById("tasks-new");
  var holdNote = document.getElementById("tasks-hold");
  var POLL_OPEN_MS = 30000;
  var POLL_CLOSED_MS = 5000;

  var paused = false;
  var heard = 0;         // events heard while held
  var inFlight = false;
  var again = false;
  var lastPoll = Date.now();

  function part() { return live.querySelector("[data-tasks]"); }

  function holdReason() {
    if (paused) return "paused";
    var p = part();
    if (p && p.hasAttribute("data-before")) return "older tasks";
    var selection = window.getSelection && window.getSelection();
    if (selection && !selection.isCollapsed && selection.anchorNode &&
        live.contains(selection.anchorNode)) return "text selected";
    if (live.querySelector("tbody:hover")) return "pointer on the rows";
    var table = live.querySelector("table");
    if (table && table.getBoundingClientRect().top < 0) return "scrolled down";
    return "";
  }

  function renderBar() {
    var reason = holdReason();
    holdNote.textContent = reason && reason !== "older tasks" ? "Held: " + reason + "." : "";
    body.dataset.tasksHeard = String(heard);
    if (!heard) {
      bar.hidden = true;
      return;
    }
    bar.textContent = heard + " update" + (heard === 1 ? "" : "s") + " since: show " +
      (reason === "older tasks" ? "the newest" : "them");
    bar.hidden = false;
  }

  function listUrl() {
    var p = part();
    var query = p ? p.getAttribute("data-query") : "";
    return live.getAttribute("data-list-url") + (query ? "?" + query : "");
  }

  function refresh() {
    if (holdReason()) {
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
        refresh();
      }
    };
    htmx.ajax("GET", listUrl(), {source: live, target: live, swap: "innerHTML"}).then(done, done);
  }

  function setPaused(value) {
    paused = value;
    pauseButton.setAttribute("aria-pressed", paused ? "true" : "false");
    pauseButton.textContent = paused ? "Resume" : "Pause";
    body.dataset.tasksPaused = paused ? "true" : "false";
    if (!paused && heard) refresh();
    renderBar();
  }

  body.addEventListener("a2a_message", function () {
    if (holdReason()) {
      heard += 1;
      renderBar();
    }
  });
  body.addEventListener("reach:changed", function () {
    if (!holdReason()) refresh();
  });
  body.addEventListener("reach:stream-resync", refresh);

  document.body.addEventListener("htmx:afterSwap", function (event) {
    if (event.detail.target !== live) return;
    heard = 0;
    renderBar();
  });

  pauseButton.addEventListener("click", function () { setPaused(!paused); });
  bar.addEventListener("click", function () {
    var p = part();
    if (p && p.hasAttribute("data-before")) {
      location.href = live.getAttribute("data-list-url") +
        (p.getAttribute("data-query") ? "?" + p.getAttribute("data-query") : "");
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

  function holdMayHaveEnded() {
    if (!holdReason() && heard) refresh();
    renderBar();
  }
  live.addEventListener("pointerleave", holdMayHaveEnded);
  window.addEventListener("scroll", holdMayHaveEnded, {passive: true});

  setInterval(function () {
    var every = body.dataset.streamState === "open" ? POLL_OPEN_MS : POLL_CLOSED_MS;
    if (Date.now() - lastPoll < every) return;
    lastPoll = Date.now();
    refresh();
  }, 1000);

  renderBar();
})();
