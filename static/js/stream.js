// Turns the console's event stream into DOM events, so page parts refresh from pushes instead
// of polling. A page opts in with <body data-stream="/ws/timeline/"> (empty: no stream).
//
// For every event of every frame {"events": [...]} it dispatches a CustomEvent of exactly the
// event's name (a2a_message, a2a_failed) on document.body with the event as `detail`, so
// htmx parts can listen to them. Parts that only need "something changed" listen to
// reach:changed instead: at most one a second while events arrive, and always one after the
// last. (htmx's own `throttle:` drops the events of its pause, so after a burst a part would
// show the burst's start until the next event or the slow poll.)
//
// A push is only a hint: when the socket comes back after a gap, events were lost, so it
// dispatches reach:stream-resync and page parts re-read the table. The state is kept in
// body[data-stream-state] (connecting | open | closed) and announced as reach:stream-state.
(function () {
  "use strict";
  var MIN_DELAY_MS = 500;
  var MAX_DELAY_MS = 15000;
  var STABLE_MS = 5000;
  // Close codes set by messages/consumers.py.
  var CLOSE_UNAUTHORIZED = 4401;
  var CLOSE_NO_ROLE = 4403;

  var body = document.body;
  var path = body && body.getAttribute("data-stream");
  if (!path || !window.WebSocket) return;

  var url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + path;
  var delay = MIN_DELAY_MS;
  var everOpened = false;
  var stopped = false;
  var timer = null;
  var socket = null;

  function emit(name, detail) {
    body.dispatchEvent(new CustomEvent(name, {detail: detail}));
  }

  function setState(state, reason) {
    if (body.dataset.streamState === state) return;
    body.dataset.streamState = state;
    if (reason) body.dataset.streamReason = reason;
    else delete body.dataset.streamReason;
    showState();
    emit("reach:stream-state", {state: state, reason: reason || ""});
  }

  // The header's words for the state. Said again after every htmx swap: a boosted action
  // (Resend, Drain) swaps the page's body, header included, while this socket lives on,
  // and the new header's indicator came empty until the state next changed.
  function showState() {
    var indicator = document.querySelector("[data-stream-indicator]");
    var state = body.dataset.streamState;
    if (!indicator || !state) return;
    indicator.textContent = state === "open" ? "Live"
      : (body.dataset.streamReason || "Connecting…");
    indicator.setAttribute("data-state", state);
  }
  document.addEventListener("htmx:afterSettle", showState);

  function schedule() {
    if (stopped || timer !== null) return;
    // Jitter spreads the reconnects of many open pages after a console restart.
    var wait = delay / 2 + Math.random() * delay / 2;
    delay = Math.min(delay * 2, MAX_DELAY_MS);
    timer = setTimeout(function () { timer = null; connect(); }, wait);
  }

  // Regions that show counts of everything (the roster, the nodes) re-read at most once a
  // second (static/js/pace.js).
  var changed = window.reachPaced(1000, function () { emit("reach:changed", {}); });

  function onFrame(message) {
    var frame;
    try {
      frame = JSON.parse(message.data);
    } catch (e) {
      return;  // Not ours to judge; the next frame or a resync brings the page up to date.
    }
    var events = (frame && frame.events) || [];
    for (var i = 0; i < events.length; i++) {
      var ev = events[i];
      if (ev && typeof ev.event === "string") emit(ev.event, ev);
    }
    if (events.length) changed();
  }

  function connect() {
    setState("connecting");
    try {
      socket = new WebSocket(url);
    } catch (e) {
      setState("closed", "The live stream could not be opened.");
      schedule();
      return;
    }
    var openedAt = 0;
    socket.onopen = function () {
      openedAt = Date.now();
      setState("open");
      // Anything emitted while the socket was down never reached this page.
      if (everOpened) emit("reach:stream-resync", {});
      everOpened = true;
    };
    socket.onmessage = onFrame;
    socket.onclose = function (event) {
      socket = null;
      if (event.code === CLOSE_UNAUTHORIZED) {
        // Retrying cannot help: the session ended. Say so rather than loop.
        stopped = true;
        setState("closed", "Signed out: live updates stopped. Sign in again and reload.");
        return;
      }
      if (event.code === CLOSE_NO_ROLE) {
        stopped = true;
        setState("closed", "Your account has no role in this console any more: live updates stopped.");
        return;
      }
      // Back to a quick retry only after a socket that lasted: a server that accepts and
      // closes at once (overloaded, restarting) must not be hammered every half second.
      if (openedAt && Date.now() - openedAt > STABLE_MS) delay = MIN_DELAY_MS;
      setState("closed", "Live updates interrupted; reconnecting.");
      schedule();
    };
  }

  // A page coming back from the background or the network returning: try now, not after
  // the remaining backoff.
  window.addEventListener("online", function () {
    if (socket === null && !stopped && timer !== null) {
      clearTimeout(timer);
      timer = null;
      connect();
    }
  });

  connect();
})();
