// The overview's live part follows the stream: at most one re-read every 2 s while messages
// change, and always one after the last change of a burst (static/js/pace.js), announced as
// reach:overview-refresh, which the live part's hx-trigger listens to.
(function () {
  "use strict";
  var body = document.body;
  body.addEventListener("a2a_message", window.reachPaced(2000, function () {
    body.dispatchEvent(new CustomEvent("reach:overview-refresh"));
  }));
})();
