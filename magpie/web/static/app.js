// magpie dashboard: remember the operator token for this tab (sessionStorage), fill it into action forms.
(function () {
  "use strict";
  var KEY = "magpie-web-token";
  function stored() { try { return sessionStorage.getItem(KEY) || ""; } catch (e) { return ""; } }
  document.addEventListener("DOMContentLoaded", function () {
    var token = stored();
    document.querySelectorAll("form.action input.token").forEach(function (input) {
      if (token && !input.value) { input.value = token; }
    });
    document.querySelectorAll("form.action").forEach(function (form) {
      form.addEventListener("submit", function () {
        var input = form.querySelector("input.token");
        if (input && input.value) { try { sessionStorage.setItem(KEY, input.value); } catch (e) { /* private mode */ } }
      });
    });
  });
})();
