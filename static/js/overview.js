// The overview's live part follows the stream: at most one re-read per interval while
// messages change, and always one after the last change of a burst.
//
// htmx's own `throttle:` drops the events that arrive during its pause, so the last changes
// of a burst would wait for the slow poll (15 s); `delay:` never fires while traffic goes
// on. This keeps both edges and tells htmx with one event, reach:overview-refresh, which
// the live part's hx-trigger listens to.
(function () {
  "use strict";
  var INTERVAL_MS = 2000;
  var body = document.body;
  var timer = null;
  var pending = false;

  function refresh() {
    body.dispatchEvent(new CustomEvent("reach:overview-refresh"));
  }

  function settle() {
    if (pending) {
      pending = false;
      refresh();
      timer = setTimeout(settle, INTERVAL_MS);
    } else {
      timer = null;
    }
  }

  body.addEventListener("a2a_message", function () {
    if (timer !== null) {
      pending = true;
      return;
    }
    refresh();
    timer = setTimeout(settle, INTERVAL_MS);
  });
})();
