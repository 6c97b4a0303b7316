// The one pacing of live regions: `reachPaced(gapMs, fn)` returns a trigger that calls `fn`
// at most once per `gapMs` however fast it is pulled, at once after a quiet spell, and never
// leaves a pull uncovered (a call already scheduled runs after it, so it covers it). htmx's
// own `throttle:` drops the last pull of a burst, leaving a region a step behind until its
// slow poll; `delay:` never fires while pulls go on. Used by the stream (reach:changed), the
// overview, the trace and the timeline. Plain ES5.
(function () {
  "use strict";
  window.reachPaced = function (gapMs, fn) {
    var timer = null;
    var firedAt = 0;
    return function () {
      if (timer !== null) return;
      timer = setTimeout(function () {
        timer = null;
        firedAt = Date.now();
        fn();
      }, Math.max(0, firedAt + gapMs - Date.now()));
    };
  };
})();
