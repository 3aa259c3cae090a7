// Shared by the playground, the classifiers and the status pages: a DOM builder (text only, never HTML, so a
// value from a request can never become markup), number formatting, the probability bar, and the "untrained
// model" banner.
"use strict";

window.Clef = (function () {
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "text") el.textContent = value;
      else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
      else el.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }

  function formatBytes(n) {
    if (n === null || n === undefined) return "-";
    const units = ["B", "KiB", "MiB", "GiB"];
    let value = n;
    let unit = 0;
    while (value >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit += 1;
    }
    return (unit === 0 ? String(value) : value.toFixed(1)) + " " + units[unit];
  }

  function formatMs(ms) {
    return ms === null || ms === undefined ? "-" : ms.toFixed(1) + " ms";
  }

  function percent(p) {
    return (p * 100).toFixed(1) + " %";
  }

  // One option's probability as a labelled meter (the playground's and the classifiers page's answers).
  function bar(qid, optionId, p, top, label) {
    const fill = h("div", { class: "fill" });
    fill.style.width = Math.max(0, Math.min(1, p)) * 100 + "%";
    return h("div", { class: "bar-row" + (top ? " top" : "") },
      h("span", { class: "name", text: label || optionId }),
      h("div", {
        class: "bar", role: "meter", "aria-label": qid + ": " + optionId,
        "aria-valuenow": String(p), "aria-valuemin": "0", "aria-valuemax": "1",
        "aria-valuetext": p + " (" + percent(p) + ")",
      }, fill),
      h("span", { class: "value", text: p.toFixed(4) }),
    );
  }

  async function fetchStatus() {
    const response = await fetch("/status.json", { headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error("/status.json answered " + response.status);
    return response.json();
  }

  function showBanner(status) {
    const banner = document.getElementById("model-banner");
    if (!banner) return;
    banner.hidden = !status.untrained;
    banner.textContent = status.untrained
      ? "This server runs " + status.model + ", an UNTRAINED model with random weights: " +
        "its probabilities show how the API works, not real decisions."
      : "";
  }

  // The "usage" list under a page's answers: one name/value row per known figure (an undefined or null
  // value is left out, so a figure the server did not send is not shown as empty).
  function showUsage(dl, rows) {
    dl.replaceChildren();
    for (const [name, value] of rows) {
      if (value === undefined || value === null) continue;
      dl.append(h("dt", { text: name }), h("dd", { text: String(value) }));
    }
    dl.hidden = false;
  }

  // The API key field of the playground and the classifiers page: one sessionStorage entry, so a key typed
  // on either page serves both, and it never outlives the browser tab. ``onChange`` runs on ``eventName``.
  const KEY_STORAGE = "clef-playground-api-key";
  function bindApiKey(input, eventName, onChange) {
    input.value = sessionStorage.getItem(KEY_STORAGE) || "";
    input.addEventListener(eventName, () => {
      if (input.value) sessionStorage.setItem(KEY_STORAGE, input.value);
      else sessionStorage.removeItem(KEY_STORAGE);
      onChange();
    });
  }

  return { h, bar, formatBytes, formatMs, percent, fetchStatus, showBanner, showUsage, bindApiKey };
})();
