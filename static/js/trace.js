/* The trace page (templates/messages/trace.html): of the events the stream dispatches on
   <body> (static/js/stream.js), keep those of this task (or of one of its transmissions) and
   announce them as reach:trace-changed, which refreshes the trace's fragment. Plain ES5. */
(function () {
  "use strict";

  function ids() {
    var el = document.getElementById("trace-ids");
    if (!el) { return null; }
    return {
      task: el.getAttribute("data-task-id") || "",
      messages: (el.getAttribute("data-message-ids") || "").split(" ")
    };
  }

  function mine(detail) {
    var known = ids();
    if (!known || !detail) { return false; }
    if (known.task && detail.taskId === known.task) { return true; }
    return !!detail.messageId && known.messages.indexOf(detail.messageId) !== -1;
  }

  // At most one re-read every EVERY_MS, and always one after the last event: a task's
  // SENT, PUBLISHED and ACKED often arrive within half a second, and htmx's own `throttle:`
  // would drop the last of them, leaving the trace a step behind until the slow poll.
  var EVERY_MS = 500;
  var timer = null;
  var firedAt = 0;

  function onEvent(e) {
    // A timer already set fires after this event, so it covers it.
    if (!mine(e.detail) || timer !== null) { return; }
    timer = setTimeout(function () {
      timer = null;
      firedAt = Date.now();
      document.body.dispatchEvent(new CustomEvent("reach:trace-changed"));
    }, Math.max(0, firedAt + EVERY_MS - Date.now()));
  }

  document.body.addEventListener("a2a_message", onEvent);
}());
