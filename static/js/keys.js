// Keys every page answers: "/" puts the cursor in the page's search field, "?" opens the
// list of keys (the dialog in templates/base.html). "p" (pause) belongs to the live lists
// (static/js/tasks.js, timeline.js). None of them acts while a person types in a field.
(function () {
  "use strict";

  function typing(target) {
    var tag = target && target.tagName;
    return tag === "INPUT" || tag === "TEXTAREA" || tag === "SELECT" ||
      (target && target.isContentEditable);
  }

  function searchField() {
    return document.querySelector("main input[name=q]") ||
      document.querySelector("main input[type=search]") ||
      document.querySelector("main form input:not([type=hidden]):not([type=checkbox])");
  }

  document.addEventListener("keydown", function (event) {
    if (event.ctrlKey || event.metaKey || event.altKey || typing(event.target)) return;
    var help = document.getElementById("keys-help");
    if (event.key === "?" && help) {
      event.preventDefault();
      if (help.open) help.close(); else help.showModal();
    } else if (event.key === "/") {
      var field = searchField();
      if (!field) return;
      event.preventDefault();
      field.focus();
      if (field.select) field.select();
    }
  });
})();
