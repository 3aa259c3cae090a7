// Shared by the playground, the classifiers and the status pages: a DOM builder (text only, never HTML, so a
// value from a request can never become markup), number formatting, the probability bar, the "untrained
// model" banner, and the evidence of an explained decision (x_explain): its controls, the state text with
// each answer's evidence marked, the boxes on the images, and the list of spans under each answer.
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

  // ------------------------------------------------------------------------------------------ evidence

  const GRANULARITIES = ["word", "token", "field"];
  const MAX_TOP_K = 20;

  // The "Explain" controls: a checkbox, top_k and granularity. ``value()`` is the request's x_explain
  // (undefined when off); ``set(x)`` shows a request's x_explain (true: the server's defaults, 5 and word).
  // A top_k out of range is sent as typed, so the server's 422 names x_explain.top_k.
  function explainControls(onChange) {
    const on = h("input", { type: "checkbox", id: "explain" });
    const topK = h("input", { type: "number", id: "explain-top-k", min: 1, max: MAX_TOP_K, step: 1, value: 5 });
    const granularity = h("select", { id: "explain-granularity" },
      ...GRANULARITIES.map((g) => h("option", { value: g, text: g })));
    const element = h("fieldset", { class: "explain" },
      h("legend", { text: "Evidence" }),
      h("div", { class: "row" },
        h("label", { class: "check" }, on, " Explain each answer"),
        h("label", { for: "explain-top-k", text: "Spans per answer (1-" + MAX_TOP_K + ")" }), topK,
        h("label", { for: "explain-granularity", text: "Granularity" }), granularity),
      h("p", { class: "hint", text: "Sends x_explain: each answer then lists the parts of the state that " +
        "most support it, marked in the state text under Answers." }));
    const value = () => {
      if (!on.checked) return undefined;
      const out = {};
      if (topK.value.trim() !== "") out.top_k = Number(topK.value);
      out.granularity = granularity.value;
      return out;
    };
    const set = (x) => {
      on.checked = Boolean(x);
      const options = x && typeof x === "object" ? x : {};
      topK.value = options.top_k === undefined ? "5" : String(options.top_k);
      granularity.value = GRANULARITIES.includes(options.granularity) ? options.granularity : "word";
      topK.disabled = granularity.disabled = !on.checked;
    };
    for (const input of [on, topK, granularity]) {
      input.addEventListener(input === topK ? "input" : "change", () => {
        topK.disabled = granularity.disabled = !on.checked;
        onChange(value());
      });
    }
    set(undefined);
    return { element, value, set };
  }

  // Evidence offsets are Python str indexes (Unicode code points); JS strings index UTF-16 code units, where
  // an astral character (an emoji) takes two. Entry i is the code unit index of code point i (and the last
  // entry the string's length), so offsets past an emoji still land on the right characters.
  function codeUnitOffsets(text) {
    const offsets = [0];
    let at = 0;
    for (const ch of text) {
      at += ch.length;
      offsets.push(at);
    }
    return offsets;
  }

  function formatWeight(weight) {
    return (weight >= 0 ? "+" : "") + weight.toFixed(4);
  }

  function isTextItem(item) {
    return Number.isInteger(item.start) && Number.isInteger(item.end) && typeof item.weight === "number";
  }

  // What a span or a box says on hover: the question, its rank and weight (and where in a JSON state).
  function evidenceTitle(qid, rank, item) {
    return qid + " · evidence " + rank + " · weight " + formatWeight(item.weight) +
      (item.path !== undefined ? " · " + (item.path || "(the whole state)") : "");
  }

  // Opacity grows with |weight| relative to the answer's strongest item; the sign picks the hue.
  function strength(item, strongest) {
    return (0.2 + 0.7 * Math.abs(item.weight) / (strongest || 1)).toFixed(3);
  }

  function strongestWeight(items) {
    return Math.max(0, ...items.filter((item) => typeof item.weight === "number").map((i) => Math.abs(i.weight)));
  }

  // The state text as text nodes with a <mark> per evidence span of one answer. Spans that fall outside the
  // text or overlap an earlier one are left unmarked (they are still in the answer's list).
  function markedText(text, items, qid) {
    const offsets = codeUnitOffsets(text);
    const last = offsets.length - 1;
    const strongest = strongestWeight(items);
    const spans = items
      .map((item, index) => ({ item, rank: index + 1 }))
      .filter(({ item }) => isTextItem(item) && item.start >= 0 && item.start < item.end && item.end <= last)
      .sort((a, b) => a.item.start - b.item.start);
    const block = h("p", { class: "evidence-text", "aria-label": "State text with the evidence for " + qid });
    let done = 0;
    for (const { item, rank } of spans) {
      if (item.start < done) continue;
      block.append(text.slice(offsets[done], offsets[item.start]));
      const mark = h("mark", {
        class: "evidence " + (item.weight < 0 ? "negative" : "positive"),
        title: evidenceTitle(qid, rank, item), "data-rank": rank, "data-weight": item.weight,
        text: text.slice(offsets[item.start], offsets[item.end]),
      });
      mark.style.setProperty("--strength", strength(item, strongest));
      block.append(mark);
      done = item.end;
    }
    block.append(text.slice(offsets[done]));
    return block;
  }

  // The images with a box per patch of one answer's evidence (box: pixels of the image as sent, so it is
  // placed in percent of the image's natural size once that is known).
  function imageFigure(url, index, items, qid) {
    const img = h("img", { src: url, alt: "Image " + (index + 1) });
    const frame = h("div", { class: "frame" }, img);
    const strongest = strongestWeight(items);
    const place = () => {
      items.forEach((item, i) => {
        if (item.image !== index || !Array.isArray(item.box) || item.box.length !== 4) return;
        const [x0, y0, x1, y1] = item.box;
        const box = h("div", {
          class: "evidence-box " + (item.weight < 0 ? "negative" : "positive"),
          title: evidenceTitle(qid, i + 1, item), "data-rank": i + 1, role: "img",
          "aria-label": "Evidence " + (i + 1) + " for " + qid + ": box " + item.box.join(", ") +
            ", weight " + formatWeight(item.weight),
        });
        box.style.left = (100 * x0 / img.naturalWidth) + "%";
        box.style.top = (100 * y0 / img.naturalHeight) + "%";
        box.style.width = (100 * (x1 - x0) / img.naturalWidth) + "%";
        box.style.height = (100 * (y1 - y0) / img.naturalHeight) + "%";
        box.style.setProperty("--strength", strength(item, strongest));
        frame.append(box);
      });
    };
    if (img.complete && img.naturalWidth) place();
    else img.addEventListener("load", place, { once: true });
    return h("figure", { class: "evidence-image" }, frame, h("figcaption", { text: "Image " + (index + 1) }));
  }

  // The list under an answer: each evidence item, strongest first, as text (the accessible form of the
  // marks and boxes).
  function evidenceList(qid, items) {
    if (!Array.isArray(items)) return null;
    const list = h("ol", { class: "evidence-list", "aria-label": "Evidence for " + qid });
    for (const item of items) {
      const weight = typeof item.weight === "number" ? formatWeight(item.weight) : "?";
      const what = Array.isArray(item.box)
        ? ["image " + (Number(item.image) + 1) + ", box [" + item.box.join(", ") + "]"]
        : [h("q", { text: String(item.text ?? "") }), " at " + item.start + "-" + item.end];
      list.append(h("li", { class: item.weight < 0 ? "negative" : "positive" },
        h("span", { class: "weight", text: weight }), " ", ...what,
        item.path !== undefined ? h("code", { class: "path", text: item.path || "/" }) : null));
    }
    return h("div", { class: "evidence-answer" },
      h("p", { class: "note", text: items.length ? "Evidence, strongest first:" : "No evidence for this answer." }),
      items.length ? list : null);
  }

  // The evidence panel of an explained response: a question selector, the state text (``stateText``: the
  // string state as sent, else the response's x_explain.state_text) with that answer's spans marked, and
  // the image previews (``imageUrls``: one data URL or null per image as sent) with its boxes. Hidden
  // without evidence.
  function showEvidence(container, body, stateText, imageUrls) {
    container.replaceChildren();
    const answers = Object.entries(body.answers || {}).filter(([, a]) => Array.isArray(a.x_evidence));
    container.hidden = answers.length === 0;
    if (!answers.length) return;
    const record = body.x_explain || {};
    const text = typeof stateText === "string" ? stateText : record.state_text;
    const select = h("select", { id: "evidence-question" },
      ...answers.map(([qid]) => h("option", { value: qid, text: qid })));
    const view = h("div", { class: "evidence-view" });
    const show = () => {
      const items = answers.find(([qid]) => qid === select.value)[1].x_evidence;
      view.replaceChildren(
        typeof text === "string" ? markedText(text, items, select.value)
          : h("p", { class: "note", text: "The server sent no state_text: only the lists below." }),
        ...(imageUrls || []).flatMap((url, i) => (url ? [imageFigure(url, i, items, select.value)] : [])),
      );
    };
    select.addEventListener("change", show);
    container.append(
      h("h3", { text: "Evidence" }),
      h("div", { class: "row" }, h("label", { for: "evidence-question", text: "Highlight the evidence for" }), select),
      h("p", { class: "note", text: "Method " + (record.method || "?") + " · " + (record.granularity || "?") +
        " granularity" + (record.weights ? " · " + record.weights : "") +
        ". Orange marks support the answer, blue (dashed) ones weigh against it; the stronger, the darker. " +
        "Hover a mark for its weight." }),
      view,
    );
    show();
  }

  return {
    h, bar, formatBytes, formatMs, percent, fetchStatus, showBanner, showUsage, bindApiKey,
    explainControls, codeUnitOffsets, evidenceList, showEvidence,
  };
})();
