// Times in UTC (as the server writes them) or in the viewer's own zone, by the viewer's
// choice: the header's toggle, kept per account in this browser. Each time is a
// <time datetime data-format> of the `moment` filter (reachconsole/templatetags/moments.py);
// in local time its UTC text stays on hover. Words naming the zone are <span data-tz>.
(function () {
  "use strict";
  var user = document.body.getAttribute("data-user") || "";
  var key = "reach.times." + user;

  function pad(n, width) {
    n = String(n);
    while (n.length < (width || 2)) n = "0" + n;
    return n;
  }

  function zone() {
    try {
      var part = new Intl.DateTimeFormat(undefined, {timeZoneName: "short"})
        .formatToParts(new Date()).filter(function (p) { return p.type === "timeZoneName"; });
      return part.length ? part[0].value : "local";
    } catch (e) {
      return "local";
    }
  }

  // Django's tokens the templates use, in the browser's zone. Microseconds come from the
  // ISO text itself (a Date keeps milliseconds only).
  function formatLocal(iso, fmt) {
    var when = new Date(iso);
    if (isNaN(when.getTime())) return null;
    var fraction = (iso.match(/\.(\d+)/) || [null, "0"])[1];
    var micro = (fraction + "000000").slice(0, 6);
    var tokens = {
      Y: String(when.getFullYear()), m: pad(when.getMonth() + 1), d: pad(when.getDate()),
      H: pad(when.getHours()), i: pad(when.getMinutes()), s: pad(when.getSeconds()),
      u: micro, v: micro.slice(0, 3), T: zone()
    };
    var out = "";
    for (var i = 0; i < fmt.length; i++) {
      var c = fmt.charAt(i);
      out += Object.prototype.hasOwnProperty.call(tokens, c) ? tokens[c] : c;
    }
    return out;
  }

  function local() {
    try {
      return window.localStorage.getItem(key) === "local";
    } catch (e) {
      return false;
    }
  }

  function apply(root) {
    var inLocal = local();
    (root || document).querySelectorAll("time[datetime][data-format]").forEach(function (el) {
      if (!el.hasAttribute("data-utc")) el.setAttribute("data-utc", el.textContent);
      var utc = el.getAttribute("data-utc");
      var shown = inLocal ? formatLocal(el.getAttribute("datetime"),
                                        el.getAttribute("data-format")) : null;
      el.textContent = shown || utc;
      if (shown) el.title = utc + (/UTC$/.test(utc) ? "" : " UTC"); else el.removeAttribute("title");
    });
    (root || document).querySelectorAll("[data-tz]").forEach(function (el) {
      el.textContent = inLocal ? zone() : "UTC";
    });
    var toggle = document.querySelector("[data-times-toggle]");
    if (toggle) {
      toggle.textContent = inLocal ? "Times: " + zone() : "Times: UTC";
      toggle.setAttribute("aria-pressed", inLocal ? "true" : "false");
    }
  }

  document.addEventListener("click", function (event) {
    var toggle = event.target.closest && event.target.closest("[data-times-toggle]");
    if (!toggle) return;
    try {
      window.localStorage.setItem(key, local() ? "utc" : "local");
    } catch (e) {
      return;  // no storage: the choice cannot be kept
    }
    apply(document);
  });
  // Live fragments bring new times (and new labels) with every swap.
  document.addEventListener("htmx:load", function (event) { apply(event.detail.elt); });
  apply(document);
})();
