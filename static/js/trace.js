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

  // At most one re-read every 500 ms, and always one after the last event
  // (static/js/pace.js): a task's SENT, PUBLISHED and ACKED often arrive within half a second.
  var changed = window.reachPaced(500, function () {
    document.body.dispatchEvent(new CustomEvent("reach:trace-changed"));
  });

  document.body.addEventListener("a2a_message", function (e) {
    if (mine(e.detail)) { changed(); }
  });
}());
