// Says why an htmx request failed. htmx swaps no 4xx/5xx answer by itself, so without this
// a refused action or a failing refresh leaves the page as it was, silently. The words come
// from the console's error fragment (templates/errors/_error.html) or the API's JSON
// `detail`, and are shown as text (textContent), never as HTML.
(function () {
  "use strict";
  var failedFrom = null;

  function banner() {
    return document.getElementById("request-error");
  }

  function show(text, source) {
    var box = banner();
    if (!box) return;
    box.querySelector("[data-text]").textContent = text;
    box.hidden = false;
    failedFrom = source || null;
  }

  function hide() {
    var box = banner();
    if (box) box.hidden = true;
    failedFrom = null;
  }

  function wordsOf(xhr) {
    var type = xhr.getResponseHeader("Content-Type") || "";
    var body = xhr.responseText || "";
    if (type.indexOf("application/json") === 0) {
      try {
        return JSON.parse(body).detail || "";
      } catch (e) {
        return "";
      }
    }
    // DOMParser runs no script and loads nothing; only the text is taken.
    var doc = new DOMParser().parseFromString(body, "text/html");
    var title = doc.querySelector("[data-error-title]");
    var detail = doc.querySelector("[data-error-detail]");
    if (detail) {
      return (title ? title.textContent.trim() + ": " : "") + detail.textContent.trim();
    }
    return "";
  }

  document.addEventListener("htmx:responseError", function (event) {
    var xhr = event.detail.xhr;
    show(wordsOf(xhr) || "The console answered " + xhr.status + " " + xhr.statusText +
         " and did not say why; reload the page.", event.detail.elt);
  });

  document.addEventListener("htmx:sendError", function (event) {
    show("The console did not answer (network, or the console is restarting). Pages that " +
         "refresh themselves try again on their own.", event.detail.elt);
  });

  // The same element succeeding again (a refreshing table after a blip) clears the message.
  document.addEventListener("htmx:afterRequest", function (event) {
    if (event.detail.successful && failedFrom !== null && event.detail.elt === failedFrom) {
      hide();
    }
  });

  document.addEventListener("click", function (event) {
    if (event.target.closest && event.target.closest("#request-error [data-dismiss]")) hide();
  });
})();
