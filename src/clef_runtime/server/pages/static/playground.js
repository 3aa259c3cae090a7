// The playground: a form and a "Request JSON" text box that edit the same System One request, a Decide
// button that posts it to /v1/systemone, and the answers as one bar (role "meter") per option. With
// "Explain" on, the request carries x_explain and each answer's evidence is marked in the state text.
"use strict";

(function () {
  const {
    h, bar, formatMs, fetchStatus, showBanner, showUsage, bindApiKey, explainControls, evidenceList, showEvidence,
  } = window.Clef;
  const MAX_IMAGES = 4;

  // ------------------------------------------------------------------------------------------ examples

  function sampleImage() {
    // A small picture drawn here (a red mug on a blue table), so the example needs no file from elsewhere.
    const canvas = document.createElement("canvas");
    canvas.width = 64;
    canvas.height = 64;
    const g = canvas.getContext("2d");
    g.fillStyle = "#dbe9f6";
    g.fillRect(0, 0, 64, 64);
    g.fillStyle = "#1f4e79";
    g.fillRect(0, 44, 64, 20);
    g.fillStyle = "#c0392b";
    g.fillRect(20, 18, 22, 28);
    g.strokeStyle = "#c0392b";
    g.lineWidth = 4;
    g.strokeRect(42, 24, 8, 12);
    return canvas.toDataURL("image/png");
  }

  const EXAMPLES = [
    {
      name: "Support ticket (yes/no, choice, score)",
      build: () => ({
        state: "Hi, I was charged twice for order #1042 and the package still hasn't arrived. " +
          "Please refund the second charge today.",
        questions: {
          refund: { type: "noul", instructions: "Does the customer ask for a refund?" },
          topic: {
            type: "choice",
            instructions: "What is the ticket mainly about?",
            criteria: {
              billing: "Charges, invoices, refunds",
              shipping: "Delivery, tracking, lost parcels",
              technical: "The product or the website does not work",
            },
          },
          urgency: {
            type: "score",
            instructions: "How urgent is the ticket?",
            criteria: ["Can wait a week", "Answer within a day", "Answer now"],
          },
        },
      }),
    },
    {
      name: "Order as JSON state",
      build: () => ({
        state: { order_id: 1042, total_eur: 1899.0, country: "DE", shipping_country: "BR", new_account: true },
        questions: {
          fraud: {
            type: "noul",
            instructions: "Is this order likely fraudulent?",
            criteria: { true: "Needs a manual review before shipping", false: "Safe to ship" },
          },
          queue: {
            type: "choice",
            instructions: "Which team should handle the order?",
            criteria: { fulfilment: null, risk: "The risk team reviews suspicious orders", vip: null },
          },
        },
      }),
    },
    {
      name: "Product photo (image)",
      build: () => ({
        state: "Customer photo of the item they received.",
        images: [sampleImage()],
        questions: {
          damaged: { type: "noul", instructions: "Is the item damaged?" },
          color: {
            type: "choice",
            instructions: "What color is the item?",
            criteria: { red: null, green: null, blue: null },
          },
        },
      }),
    },
    {
      name: "Review rating (score with 5 levels)",
      build: () => ({
        state: "The blender is loud but it crushes ice in seconds. Would buy again.",
        questions: {
          rating: {
            type: "score",
            instructions: "How satisfied is the reviewer?",
            criteria: ["Very unhappy", "Unhappy", "Neutral", "Happy", "Very happy"],
          },
        },
      }),
    },
  ];

  // --------------------------------------------------------------------------------------------- state

  let request = EXAMPLES[0].build();
  let stateKind = "text"; // how the state box shows request.state: "text" or "json"
  let snippetKind = "curl";
  let uid = 0;
  const $ = (id) => document.getElementById(id);
  const explain = explainControls((value) => {
    if (value === undefined) delete request.x_explain;
    else request.x_explain = value;
    changed();
  });

  function nextId(prefix) {
    uid += 1;
    return prefix + "-" + uid;
  }

  function questionsOf(req) {
    return req.questions && typeof req.questions === "object" && !Array.isArray(req.questions)
      ? req.questions
      : {};
  }

  function isPlainObject(value) {
    return value !== null && typeof value === "object" && !Array.isArray(value);
  }

  function asText(value) {
    if (value === null || value === undefined) return "";
    return typeof value === "string" ? value : JSON.stringify(value);
  }

  function fromText(text) {
    // A description box holds text; JSON-looking text that parses is kept as JSON (objects are allowed).
    const trimmed = text.trim();
    if (trimmed.startsWith("{") || trimmed.startsWith("[")) {
      try {
        return JSON.parse(trimmed);
      } catch (_) {
        return text;
      }
    }
    return text;
  }

  // Rename a key of an object in place of the old one (questions and options keep their order).
  function renameKey(obj, oldKey, newKey) {
    const out = {};
    for (const [key, value] of Object.entries(obj)) out[key === oldKey ? newKey : key] = value;
    return out;
  }

  function freshKey(obj, prefix) {
    let n = Object.keys(obj).length + 1;
    while (Object.prototype.hasOwnProperty.call(obj, prefix + n)) n += 1;
    return prefix + n;
  }

  // ------------------------------------------------------------------------------ form -> request JSON

  function writeJson() {
    $("request-json").value = JSON.stringify(request, null, 2);
    $("json-error").hidden = true;
    $("request-json").classList.remove("invalid");
    renderSnippet();
  }

  function changed() {
    clearFieldErrors();
    writeJson();
  }

  function rebuild() {
    renderForm();
    changed();
  }

  // ------------------------------------------------------------------------------ request JSON -> form

  function readJson() {
    const text = $("request-json").value;
    let parsed;
    try {
      parsed = JSON.parse(text);
    } catch (exc) {
      showJsonError("Not valid JSON: " + exc.message);
      return;
    }
    if (!isPlainObject(parsed)) {
      showJsonError("The request must be a JSON object.");
      return;
    }
    $("json-error").hidden = true;
    $("request-json").classList.remove("invalid");
    request = parsed;
    stateKind = typeof request.state === "string" || request.state === undefined ? "text" : "json";
    clearFieldErrors();
    renderForm();
    renderSnippet();
  }

  function showJsonError(message) {
    const error = $("json-error");
    error.hidden = false;
    error.textContent = message;
    $("request-json").classList.add("invalid");
  }

  // --------------------------------------------------------------------------------------------- form

  function renderForm() {
    $("model").value = typeof request.model === "string" ? request.model : "";
    $("state-text").checked = stateKind === "text";
    $("state-json").checked = stateKind === "json";
    const state = request.state;
    $("state").value = stateKind === "text" ? asText(state) : JSON.stringify(state ?? null, null, 2);
    renderThumbs();
    explain.set(request.x_explain);
    const box = $("questions");
    box.replaceChildren();
    const entries = Object.entries(questionsOf(request));
    entries.forEach(([qid, question], index) => box.append(questionCard(qid, question, index)));
    if (!entries.length) box.append(h("p", { class: "hint", text: "No question yet: add one below." }));
  }

  function questionCard(qid, question, index) {
    const q = isPlainObject(question) ? question : {};
    const idInput = nextId("qid");
    const typeInput = nextId("qtype");
    const instrInput = nextId("qinstr");
    const loc = (...rest) => JSON.stringify(["questions", qid, ...rest]);
    const update = (fn) => {
      fn(request.questions[qid]);
      changed();
    };

    const idField = h("input", {
      id: idInput, type: "text", value: qid, autocomplete: "off", spellcheck: "false",
      onchange: (event) => {
        const newId = event.target.value;
        if (newId === qid) return;
        if (Object.prototype.hasOwnProperty.call(request.questions, newId)) {
          event.target.classList.add("invalid");
          event.target.setCustomValidity("another question already has this id");
          event.target.reportValidity();
          return;
        }
        request.questions = renameKey(request.questions, qid, newId);
        rebuild();
        focusLater('[data-qid="' + CSS.escape(newId) + '"] input');
      },
    });
    const typeField = h("select", {
      id: typeInput,
      onchange: (event) => {
        request.questions[qid] = convertQuestion(q, event.target.value);
        rebuild();
        focusLater('[data-qid="' + CSS.escape(qid) + '"] select');
      },
    },
      h("option", { value: "noul", text: "yes/no (noul)" }),
      h("option", { value: "choice", text: "choice" }),
      h("option", { value: "score", text: "score" }),
    );
    typeField.value = ["noul", "choice", "score"].includes(q.type) ? q.type : "noul";
    const card = h("fieldset", { class: "question", "data-qid": qid, "data-loc": loc() },
      h("legend", { text: "Question " + (index + 1) }),
      h("div", { class: "grid" },
        h("div", { "data-loc": loc("id") }, h("label", { for: idInput, text: "Question id" }), idField),
        h("div", { "data-loc": loc("type") }, h("label", { for: typeInput, text: "Type" }), typeField),
        h("button", {
          type: "button", class: "small remove", text: "Remove question",
          "aria-label": "Remove question " + qid,
          onclick: () => {
            delete request.questions[qid];
            rebuild();
            $("add-noul").focus();
          },
        }),
      ),
      h("div", { class: "field", "data-loc": loc("instructions") },
        h("label", { for: instrInput, text: "Instructions" }),
        h("textarea", {
          id: instrInput, rows: 2,
          oninput: (event) => update((target) => { target.instructions = fromText(event.target.value); }),
        }, asText(q.instructions)),
      ),
      criteriaEditor(qid, q, loc("criteria")),
    );
    return card;
  }

  function convertQuestion(q, type) {
    const out = { ...q, type };
    if (type === "noul") {
      out.criteria = isPlainObject(q.criteria) && q.type === "noul" ? q.criteria : undefined;
    } else if (type === "choice") {
      out.criteria = Array.isArray(q.criteria) && q.criteria.length
        ? Object.fromEntries(q.criteria.map((text, i) => ["option" + (i + 1), text]))
        : { yes: null, no: null };
    } else {
      out.criteria = isPlainObject(q.criteria) && q.type === "choice"
        ? Object.values(q.criteria).map((text) => text ?? "")
        : ["Low", "Medium", "High"];
    }
    if (out.criteria === undefined) delete out.criteria;
    return out;
  }

  function criteriaEditor(qid, q, loc) {
    const box = h("div", { class: "criteria", "data-loc": loc });
    const target = () => request.questions[qid];
    if (q.type === "choice") {
      const criteria = isPlainObject(q.criteria) ? q.criteria : {};
      box.append(h("p", { class: "hint", text: "Options: an id each, with an optional description." }));
      Object.entries(criteria).forEach(([optionId, description], i) => {
        const idIn = nextId("opt");
        const descIn = nextId("desc");
        box.append(h("div", { class: "option", "data-loc": JSON.stringify([...JSON.parse(loc), optionId]) },
          h("label", { for: idIn, class: "visually-hidden", text: "Option " + (i + 1) + " id" }),
          h("input", {
            id: idIn, type: "text", value: optionId, placeholder: "option id", spellcheck: "false",
            onchange: (event) => {
              const newId = event.target.value;
              if (newId === optionId) return;
              if (Object.prototype.hasOwnProperty.call(target().criteria, newId)) {
                event.target.setCustomValidity("another option already has this id");
                event.target.reportValidity();
                return;
              }
              target().criteria = renameKey(target().criteria, optionId, newId);
              rebuild();
            },
          }),
          h("label", { for: descIn, class: "visually-hidden", text: "Option " + (i + 1) + " description" }),
          h("input", {
            id: descIn, class: "desc", type: "text", value: asText(description), placeholder: "description",
            oninput: (event) => {
              const text = event.target.value;
              target().criteria[optionId] = text === "" ? null : fromText(text);
              changed();
            },
          }),
          h("button", {
            type: "button", class: "small", text: "Remove", "aria-label": "Remove option " + optionId,
            onclick: () => {
              delete target().criteria[optionId];
              rebuild();
            },
          }),
        ));
      });
      box.append(h("button", {
        type: "button", class: "small", text: "Add option",
        onclick: () => {
          if (!isPlainObject(target().criteria)) target().criteria = {};
          target().criteria[freshKey(target().criteria, "option")] = null;
          rebuild();
        },
      }));
    } else if (q.type === "score") {
      const levels = Array.isArray(q.criteria) ? q.criteria : [];
      box.append(h("p", { class: "hint", text: "Levels, lowest first (2 to 10)." }));
      levels.forEach((description, i) => {
        const descIn = nextId("level");
        box.append(h("div", { class: "option level", "data-loc": JSON.stringify([...JSON.parse(loc), i]) },
          h("label", { for: descIn, class: "level-no", text: "Level " + i }),
          h("input", {
            id: descIn, type: "text", value: asText(description),
            oninput: (event) => {
              target().criteria[i] = fromText(event.target.value);
              changed();
            },
          }),
          h("button", {
            type: "button", class: "small", text: "Remove", "aria-label": "Remove level " + i,
            onclick: () => {
              target().criteria.splice(i, 1);
              rebuild();
            },
          }),
        ));
      });
      box.append(h("button", {
        type: "button", class: "small", text: "Add level",
        onclick: () => {
          if (!Array.isArray(target().criteria)) target().criteria = [];
          target().criteria.push("Level " + target().criteria.length);
          rebuild();
        },
      }));
    } else {
      const criteria = isPlainObject(q.criteria) ? q.criteria : {};
      box.append(h("p", { class: "hint", text: "Optional descriptions of each side (empty: the model's default)." }));
      for (const side of ["true", "false"]) {
        const input = nextId("side");
        box.append(h("div", { class: "option level", "data-loc": JSON.stringify([...JSON.parse(loc), side]) },
          h("label", { for: input, text: side }),
          h("input", {
            id: input, type: "text", value: asText(criteria[side]),
            oninput: (event) => {
              const t = target();
              const next = isPlainObject(t.criteria) ? { ...t.criteria } : {};
              if (event.target.value === "") delete next[side];
              else next[side] = fromText(event.target.value);
              if (Object.keys(next).length) t.criteria = next;
              else delete t.criteria;
              changed();
            },
          }),
        ));
      }
    }
    return box;
  }

  function focusLater(selector) {
    const el = document.querySelector(selector);
    if (el) el.focus();
  }

  function addQuestion(type) {
    if (!isPlainObject(request.questions)) request.questions = {};
    const qid = freshKey(request.questions, "q");
    const question = { type, instructions: "" };
    if (type === "choice") question.criteria = { yes: null, no: null };
    if (type === "score") question.criteria = ["Low", "Medium", "High"];
    request.questions[qid] = question;
    rebuild();
    focusLater('[data-qid="' + CSS.escape(qid) + '"] textarea');
  }

  // ------------------------------------------------------------------------------------------- images

  function imageUrl(item) {
    if (typeof item === "string") return item;
    if (isPlainObject(item) && typeof item.base64 === "string") {
      return "data:" + (item.content_type || "image/png") + ";base64," + item.base64;
    }
    return null;
  }

  function renderThumbs() {
    const list = $("thumbs");
    list.replaceChildren();
    const images = Array.isArray(request.images) ? request.images : [];
    images.forEach((item, i) => {
      const url = imageUrl(item);
      list.append(h("li", { "data-loc": JSON.stringify(["images", i]) },
        url && url.startsWith("data:image/")
          ? h("img", { src: url, alt: "Image " + (i + 1) })
          : h("span", { text: "Image " + (i + 1) + " (not a data URL)" }),
        h("button", {
          type: "button", class: "small", text: "Remove", "aria-label": "Remove image " + (i + 1),
          onclick: () => {
            request.images.splice(i, 1);
            if (!request.images.length) delete request.images;
            rebuild();
          },
        }),
      ));
    });
  }

  function readAsDataUrl(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  async function addFiles(files) {
    const accepted = Array.from(files).filter((f) => /^image\/(png|jpeg|webp)$/.test(f.type));
    if (!Array.isArray(request.images)) request.images = [];
    for (const file of accepted) request.images.push(await readAsDataUrl(file));
    if (!request.images.length) delete request.images;
    rebuild();
    const skipped = files.length - accepted.length;
    if (skipped) setStatus(skipped + " file(s) skipped: only PNG, JPEG and WebP images are accepted.");
    else if (request.images && request.images.length > MAX_IMAGES) {
      setStatus("More than " + MAX_IMAGES + " images: the server will refuse the request.");
    }
  }

  // ----------------------------------------------------------------------------------------- deciding

  function setStatus(text) {
    $("decide-status").textContent = text;
  }

  function apiKey() {
    return $("api-key").value.trim();
  }

  async function decide() {
    clearFieldErrors();
    if (!$("json-error").hidden) {
      $("request-json").focus();
      return;
    }
    const headers = { "Content-Type": "application/json", Accept: "application/json" };
    if (apiKey()) headers.Authorization = "Bearer " + apiKey();
    const button = $("decide");
    button.disabled = true;
    setStatus("Deciding...");
    const started = performance.now();
    const sent = JSON.parse(JSON.stringify(request)); // the answers are about this, even if edited meanwhile
    try {
      const response = await fetch("/v1/systemone", {
        method: "POST", headers, body: JSON.stringify(sent),
      });
      const elapsed = performance.now() - started;
      let body = null;
      try {
        body = await response.json();
      } catch (_) {
        body = null;
      }
      if (response.ok && body) {
        setStatus("Answered in " + formatMs(elapsed) + ".");
        renderAnswers(body, response, elapsed, sent);
      } else {
        setStatus("The server answered " + response.status + ".");
        showErrors(response.status, body);
      }
    } catch (exc) {
      setStatus("");
      showGeneralError("The request did not reach the server: " + exc.message);
    } finally {
      button.disabled = false;
    }
  }

  function clearFieldErrors() {
    for (const el of document.querySelectorAll(".field-error.from-server")) el.remove();
    for (const el of document.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
    $("general-error").hidden = true;
  }

  function showGeneralError(text) {
    const box = $("general-error");
    box.hidden = false;
    box.textContent = text;
  }

  // The element a 422 location belongs to: the deepest form part whose data-loc is a prefix of it.
  function elementFor(loc) {
    const byLoc = new Map();
    for (const el of document.querySelectorAll("[data-loc]")) byLoc.set(el.getAttribute("data-loc"), el);
    for (let n = loc.length; n > 0; n -= 1) {
      const el = byLoc.get(JSON.stringify(loc.slice(0, n)));
      if (el) return el;
    }
    return null;
  }

  function showErrors(status, body) {
    const detail = body && body.detail;
    if (Array.isArray(detail)) {
      const unplaced = [];
      for (const item of detail) {
        // The server prefixes every location with "body" (FastAPI's convention); the form starts below it.
        const loc = Array.isArray(item.loc) ? item.loc.slice(item.loc[0] === "body" ? 1 : 0) : [];
        const where = loc.length ? loc.join(".") : "request";
        const message = where + ": " + item.msg;
        const el = elementFor(loc);
        if (!el) {
          unplaced.push(message);
          continue;
        }
        const id = nextId("err");
        el.append(h("p", { id, class: "field-error from-server", role: "alert", text: message }));
        const input = el.querySelector("input, select, textarea");
        if (input) {
          input.setAttribute("aria-invalid", "true");
          input.setAttribute("aria-describedby", id);
        }
      }
      showGeneralError(
        "The server refused the request (" + status + "): " + detail.length + " problem(s)" +
          (unplaced.length ? ": " + unplaced.join("; ") : ", shown next to their fields."),
      );
      const first = document.querySelector(".field-error.from-server");
      if (first) first.scrollIntoView({ block: "center" });
      return;
    }
    const message = detail && typeof detail === "object" ? detail.message || JSON.stringify(detail) : null;
    const hint = status === 401 ? " Enter the server's API key above." : "";
    showGeneralError("The server answered " + status + ": " + (message || "no details") + hint);
  }

  // ------------------------------------------------------------------------------------------ answers

  function round4(x) {
    return Math.round(x * 10000) / 10000;
  }

  // An answer's bars, then its evidence when the request asked for it.
  function answerCard(qid, answer, question) {
    const card = answerBars(qid, answer, question);
    const evidence = evidenceList(qid, answer.x_evidence);
    if (evidence) card.append(evidence);
    return card;
  }

  function answerBars(qid, answer, question) {
    const card = h("section", { class: "answer", "aria-label": "Answer to " + qid });
    card.append(h("h3", { text: qid }));
    if (answer.type === "noul") {
      const p = answer.noul;
      const pFalse = round4(1 - p);
      card.append(
        h("p", { class: "summary" },
          "type noul · answer ", h("strong", { text: p >= 0.5 ? "true" : "false" }),
          " · p(true) " + p + " · confidence " + Math.max(p, pFalse).toFixed(4)),
        bar(qid, "true", p, p >= pFalse),
        bar(qid, "false", pFalse, pFalse > p),
        h("p", { class: "note", text: "The API returns p(true) only; p(false) is shown as round(1 - p(true), 4), " +
          "and the confidence as the larger of the two." }),
      );
      return card;
    }
    const probs = answer.probabilities || {};
    const best = Math.max(...Object.values(probs));
    const summary = answer.type === "choice"
      ? ["type choice · answer ", h("strong", { text: answer.choice }), " · confidence " + answer.confidence]
      : ["type score · expected level ", h("strong", { text: String(answer.score) }),
        " · confidence " + answer.confidence];
    card.append(h("p", { class: "summary" }, ...summary));
    const legend = answer.legend || {};
    for (const [optionId, p] of Object.entries(probs)) {
      const description = answer.type === "score" ? asText(legend[optionId]) : "";
      const label = description ? optionId + " · " + description : optionId;
      card.append(bar(qid, optionId, p, p === best, label));
    }
    if (question && question.type !== answer.type) {
      card.append(h("p", { class: "note", text: "The request was edited since this answer." }));
    }
    return card;
  }

  function renderAnswers(body, response, elapsed, sent) {
    $("results-empty").hidden = true;
    const usage = body.usage || {};
    const details = usage.input_tokens_details || {};
    const rows = [
      ["Model", body.model],
      ["Input tokens", usage.input_tokens],
      ["Cached tokens", details.cached_tokens],
      ["Truncated state tokens", body.x_truncated_state_tokens],
      ["Server latency", body.x_latency_ms !== undefined ? formatMs(body.x_latency_ms)
        : response.headers.get("x-latency-ms") ? response.headers.get("x-latency-ms") + " ms" : undefined],
      ["Round trip", formatMs(elapsed)],
      ["State cache", response.headers.get("x-clef-state-cache")],
      ["Request id", response.headers.get("x-request-id")],
    ];
    showUsage($("usage"), rows);
    const images = Array.isArray(sent.images) ? sent.images.map(imageUrl) : [];
    showEvidence($("evidence"), body, typeof sent.state === "string" ? sent.state : undefined,
      images.map((url) => (url && url.startsWith("data:image/") ? url : null)));
    const box = $("answers");
    box.replaceChildren();
    const questions = questionsOf(request);
    for (const [qid, answer] of Object.entries(body.answers || {})) {
      box.append(answerCard(qid, answer, questions[qid]));
    }
  }

  // ------------------------------------------------------------------------------------------- copy as

  // JSON value -> Python literal (JSON string escapes are valid Python string escapes).
  function py(value, indent) {
    const pad = " ".repeat(indent + 4);
    const end = " ".repeat(indent);
    if (value === null) return "None";
    if (value === true) return "True";
    if (value === false) return "False";
    if (typeof value === "number" || typeof value === "string") return JSON.stringify(value);
    if (Array.isArray(value)) {
      if (!value.length) return "[]";
      return "[\n" + value.map((v) => pad + py(v, indent + 4) + ",\n").join("") + end + "]";
    }
    const entries = Object.entries(value);
    if (!entries.length) return "{}";
    return "{\n" + entries.map(([k, v]) => pad + JSON.stringify(k) + ": " + py(v, indent + 4) + ",\n")
      .join("") + end + "}";
  }

  function snippet(kind) {
    const base = window.location.origin;
    const keyed = apiKey() !== "";
    const images = Array.isArray(request.images) && request.images.length ? request.images : null;
    const explained = request.x_explain !== undefined && request.x_explain !== false;
    if (kind === "curl") {
      const json = JSON.stringify(request, null, 2);
      let tag = "JSON";
      while (json.split("\n").includes(tag)) tag += "_";
      return [
        "curl -sS " + base + "/v1/systemone \\",
        "  -H 'Content-Type: application/json' \\",
        keyed ? '  -H "Authorization: Bearer $CLEF_API_KEY" \\' : null,
        "  --data-binary @- <<'" + tag + "'",
        json,
        tag,
      ].filter((line) => line !== null).join("\n");
    }
    const state = "state = " + py(request.state ?? "", 0);
    const questions = "questions = " + py(questionsOf(request), 0);
    const model = typeof request.model === "string" && request.model ? request.model : null;
    if (kind === "systemone") {
      return [
        "# pip install systemone-client==0.1.0",
        keyed ? "import os\n" : null,
        "from systemone import Client",
        "",
        state,
        questions,
        images ? "# systemone-client 0.1.0 has no way to send images: this request's images are left out." : null,
        explained ? "# systemone-client 0.1.0 has no way to send x_explain: the evidence is left out." : null,
        "",
        "with Client(base_url=" + JSON.stringify(base) +
          (keyed ? ', api_key=os.environ["CLEF_API_KEY"]' : "") + ") as client:",
        "    response = client.system_one(state, questions" + (model ? ", model=" + JSON.stringify(model) : "") + ")",
        "print(response)",
      ].filter((line) => line !== null).join("\n");
    }
    return [
      "# pip install 'typesafe-sdk[zstd]==0.7.5'",
      keyed ? "import os\n" : null,
      "from typesafe_sdk import TypeSafeClient",
      "",
      state,
      questions,
      images ? "images = " + py(images, 0) : null,
      explained ? "x_explain = " + py(request.x_explain, 0) : null,
      "",
      "# The SDK requires an API key; any value works when the server has none.",
      "with TypeSafeClient(base_url=" + JSON.stringify(base) + ", api_key=" +
        (keyed ? 'os.environ["CLEF_API_KEY"]' : '"unused"') + ") as client:",
      "    response = client.system_one(",
      "        state=state,",
      "        questions=questions,",
      model ? "        model=" + JSON.stringify(model) + "," : null,
      images || explained ? "        extra_body={" + [images ? '"images": images' : null,
        explained ? '"x_explain": x_explain' : null].filter(Boolean).join(", ") + "}," : null,
      "    )",
      "print(response.model_dump_json(indent=2))",
    ].filter((line) => line !== null).join("\n");
  }

  function renderSnippet() {
    $("snippet").textContent = snippet(snippetKind);
    for (const button of document.querySelectorAll("[data-snippet]")) {
      button.setAttribute("aria-pressed", String(button.dataset.snippet === snippetKind));
    }
  }

  async function copySnippet() {
    const text = $("snippet").textContent;
    try {
      await navigator.clipboard.writeText(text);
      $("copy-status").textContent = "Copied.";
    } catch (_) {
      // No clipboard permission: select the code so Ctrl+C copies it.
      const range = document.createRange();
      range.selectNodeContents($("snippet"));
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
      $("copy-status").textContent = "Selected: press Ctrl+C to copy.";
    }
  }

  // ------------------------------------------------------------------------------------------- wiring

  function readState() {
    const text = $("state").value;
    const box = $("state");
    for (const el of box.parentElement.querySelectorAll(".field-error.local")) el.remove();
    box.classList.remove("invalid");
    if (stateKind === "text") {
      request.state = text;
    } else {
      try {
        request.state = JSON.parse(text);
      } catch (exc) {
        box.classList.add("invalid");
        box.after(h("p", { class: "field-error local", role: "alert", text: "Not valid JSON: " + exc.message }));
        return;
      }
    }
    changed();
  }

  function wire() {
    const select = $("example");
    EXAMPLES.forEach((example, i) => select.append(h("option", { value: i, text: example.name })));
    $("load-example").addEventListener("click", () => {
      request = EXAMPLES[Number(select.value)].build();
      stateKind = typeof request.state === "string" ? "text" : "json";
      $("results-empty").hidden = false;
      $("answers").replaceChildren();
      $("usage").hidden = true;
      $("evidence").hidden = true;
      rebuild();
    });
    $("model").addEventListener("input", (event) => {
      if (event.target.value) request.model = event.target.value;
      else delete request.model;
      changed();
    });
    $("state").addEventListener("input", readState);
    for (const radio of document.querySelectorAll('input[name="state-kind"]')) {
      radio.addEventListener("change", () => {
        stateKind = radio.value;
        if (stateKind === "json") {
          // Text that is JSON becomes that JSON; other text becomes a JSON string.
          try {
            request.state = JSON.parse($("state").value);
          } catch (_) {
            request.state = $("state").value;
          }
        } else {
          request.state = asText(request.state);
        }
        rebuild();
      });
    }
    $("request-json").addEventListener("input", readJson);
    $("add-noul").addEventListener("click", () => addQuestion("noul"));
    $("add-choice").addEventListener("click", () => addQuestion("choice"));
    $("add-score").addEventListener("click", () => addQuestion("score"));
    $("decide").addEventListener("click", decide);
    document.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        decide();
      }
    });

    const input = $("image-input");
    input.addEventListener("change", async () => {
      await addFiles(input.files);
      input.value = "";
    });
    const zone = $("dropzone");
    zone.addEventListener("dragover", (event) => {
      event.preventDefault();
      zone.classList.add("over");
    });
    zone.addEventListener("dragleave", () => zone.classList.remove("over"));
    zone.addEventListener("drop", (event) => {
      event.preventDefault();
      zone.classList.remove("over");
      addFiles(event.dataTransfer.files);
    });

    $("explain-controls").append(explain.element);
    bindApiKey($("api-key"), "input", renderSnippet);
    for (const button of document.querySelectorAll("[data-snippet]")) {
      button.addEventListener("click", () => {
        snippetKind = button.dataset.snippet;
        renderSnippet();
      });
    }
    $("copy-snippet").addEventListener("click", copySnippet);

    fetchStatus().then((status) => {
      showBanner(status);
      $("api-key-hint").textContent = status.auth
        ? "This server requires an API key. It is kept in this browser tab only (sessionStorage)."
        : "This server has no API keys: leave it empty. A key is kept in this browser tab only.";
    }).catch(() => {});
  }

  wire();
  rebuild();
  document.body.dataset.ready = "true";
})();
