// The saved-classifiers page: list the caller's classifiers (GET /v1/classifiers), show one's questions, and
// run it on a state (POST /v1/classifiers/{name}/decide), each option's probability drawn as a bar. The API
// key is the playground's (the same sessionStorage entry), so a key typed on either page serves both. Each
// classifier shows the head it answers with and the digest it pinned when saved; a broken pin (the server
// serves other weights under that name, or none) is marked, since deciding with it is then refused. With
// "Explain" on, the run sends x_explain and each answer's evidence is marked in the state text.
"use strict";

(function () {
  const {
    h, bar, formatMs, fetchStatus, showBanner, showUsage, bindApiKey, explainControls, evidenceList, showEvidence,
  } = window.Clef;
  const $ = (id) => document.getElementById(id);
  const explain = explainControls(() => {}); // read when Run is pressed
  let classifiers = [];

  function apiKey() {
    return $("api-key").value.trim();
  }

  function headers(json) {
    const out = { Accept: "application/json" };
    if (json) out["Content-Type"] = "application/json";
    if (apiKey()) out.Authorization = "Bearer " + apiKey();
    return out;
  }

  function asText(value) {
    return typeof value === "string" ? value : JSON.stringify(value);
  }

  // The message of an error body, whichever shape it has (validation list or {error_type, message}).
  function errorText(status, body) {
    const detail = body && body.detail;
    if (Array.isArray(detail)) {
      return detail.map((item) => {
        const loc = Array.isArray(item.loc) ? item.loc.filter((part) => part !== "body").join(".") : "";
        return (loc || "request") + ": " + item.msg;
      }).join("; ");
    }
    const message = detail && typeof detail === "object" ? detail.message : null;
    const hint = status === 401 ? " Enter the server's API key above." : "";
    return "The server answered " + status + ": " + (message || "no details") + hint;
  }

  function showError(text) {
    const box = $("general-error");
    box.hidden = !text;
    box.textContent = text || "";
  }

  async function readJson(response) {
    try {
      return await response.json();
    } catch (_) {
      return null;
    }
  }

  // ---------------------------------------------------------------------------------------- the head pin

  const DIGEST_SHOWN = 12; // hex digits shown; the full digest is in the tooltip
  // What a broken pin (head_status.status) means and what to do about it; the decide route refuses both.
  const PIN_PROBLEMS = {
    head_not_loaded: {
      badge: "head not loaded",
      hint: (c) => "Reload the head (clef serve --head " + c.head + "=DIR, or POST /v1/heads), or save " +
        "the classifier again with another head.",
    },
    head_changed: {
      badge: "head changed",
      hint: (c) => "Reload the head it was saved with, or save the classifier again (PUT /v1/classifiers/" +
        c.name + ") to accept the head served now.",
    },
  };

  function headName(classifier) {
    return classifier.head === null || classifier.head === undefined ? "default head" : classifier.head;
  }

  function pinProblem(classifier) {
    const status = classifier.head_status ? classifier.head_status.status : undefined;
    return PIN_PROBLEMS[status] || null;
  }

  function digestCode(digest) {
    return h("code", { class: "digest", title: digest, text: digest.slice(0, DIGEST_SHOWN) });
  }

  // The head line (name, pinned digest) and, for a broken pin, a badge, the digest served and what to do.
  function pinLines(classifier) {
    const headLine = h("p", { class: "pin-head" }, "Head: ", h("strong", { text: headName(classifier) }),
      " · pinned digest ",
      classifier.head_digest ? digestCode(classifier.head_digest) : "none (saved before digests were kept)");
    const status = classifier.head_status || {};
    if (status.status === "unknown") {
      headLine.append(" · ", h("span", { class: "hint", text: "not checked while the model loads" }));
    }
    const problem = pinProblem(classifier);
    if (!problem) return [headLine];
    headLine.append(" ", h("span", { class: "badge warn", text: problem.badge }));
    if (status.digest_served) headLine.append(" · served now ", digestCode(status.digest_served));
    return [headLine, h("p", { class: "hint pin-hint", text: problem.hint(classifier) })];
  }

  // ------------------------------------------------------------------------------------------- the list

  function selected() {
    return classifiers.find((c) => c.name === $("classifier").value) || null;
  }

  function questionLine(qid, question) {
    let what = "yes/no";
    if (question.type === "choice" && question.criteria) {
      what = "one of " + Object.keys(question.criteria).join(", ");
    } else if (question.type === "score" && Array.isArray(question.criteria)) {
      what = "score 0-" + (question.criteria.length - 1);
    }
    // Without instructions the model reads the question id itself, already shown.
    const asked = question.instructions === undefined || question.instructions === null
      ? "" : ": " + asText(question.instructions);
    return h("li", {}, h("code", { text: qid }), " (" + what + ")" + asked);
  }

  function showDetails() {
    const classifier = selected();
    $("details").hidden = !classifier;
    if (!classifier) return;
    $("details-heading").textContent = classifier.name + " · version " + classifier.version;
    $("pin").replaceChildren(...pinLines(classifier));
    $("description").textContent = classifier.description || "";
    $("question-list").replaceChildren(
      ...Object.entries(classifier.questions).map(([qid, question]) => questionLine(qid, question)),
    );
  }

  // A broken pin shows in the list too, so it is seen before the classifier is picked.
  function optionText(classifier) {
    const problem = pinProblem(classifier);
    return classifier.name + " (v" + classifier.version + ")" + (problem ? " · " + problem.badge : "");
  }

  async function loadList() {
    showError("");
    $("list-status").textContent = "Loading...";
    try {
      const response = await fetch("/v1/classifiers", { headers: headers(false) });
      const body = await readJson(response);
      if (!response.ok || !body) {
        $("list-status").textContent = "";
        showError(errorText(response.status, body));
        return;
      }
      const previous = $("classifier").value;
      classifiers = body.data || [];
      $("classifier").replaceChildren(
        ...classifiers.map((c) => h("option", { value: c.name, text: optionText(c) })),
      );
      if (classifiers.some((c) => c.name === previous)) $("classifier").value = previous;
      $("empty").hidden = classifiers.length > 0;
      $("list-status").textContent = classifiers.length + " saved classifier(s).";
      showDetails();
    } catch (exc) {
      $("list-status").textContent = "";
      showError("The request did not reach the server: " + exc.message);
    }
  }

  // ------------------------------------------------------------------------------------------- running

  function readState() {
    const text = $("state").value;
    const kind = document.querySelector('input[name="state-kind"]:checked').value;
    if (kind === "text") return { ok: true, value: text };
    try {
      return { ok: true, value: JSON.parse(text) };
    } catch (exc) {
      return { ok: false, message: "state: not valid JSON: " + exc.message };
    }
  }

  function isPinError(body) {
    const detail = body && body.detail;
    return Boolean(detail && !Array.isArray(detail) && PIN_PROBLEMS[detail.error_type]);
  }

  async function run() {
    const classifier = selected();
    if (!classifier) {
      showError("Pick a classifier first (none is saved for this key?).");
      return;
    }
    const state = readState();
    if (!state.ok) {
      showError(state.message);
      return;
    }
    showError("");
    const button = $("run");
    button.disabled = true;
    $("run-status").textContent = "Running...";
    const started = performance.now();
    try {
      const url = "/v1/classifiers/" + encodeURIComponent(classifier.name) + "/decide";
      const sent = { state: state.value, x_explain: explain.value() };
      const response = await fetch(url, { method: "POST", headers: headers(true), body: JSON.stringify(sent) });
      const elapsed = performance.now() - started;
      const body = await readJson(response);
      if (response.ok && body) {
        $("run-status").textContent = "Answered in " + formatMs(elapsed) + ".";
        renderAnswers(body, response, elapsed, sent);
      } else {
        $("run-status").textContent = "The server answered " + response.status + ".";
        // A refused pin (409 head_changed, 503 head_not_loaded) may be news to this page: list the pins
        // again, then show the server's message (loading the list clears the error box).
        if (isPinError(body)) await loadList();
        showError(errorText(response.status, body));
      }
    } catch (exc) {
      $("run-status").textContent = "";
      showError("The request did not reach the server: " + exc.message);
    } finally {
      button.disabled = false;
    }
  }

  // ------------------------------------------------------------------------------------------- answers

  // An answer's bars, then its evidence when the run asked for it.
  function answerCard(qid, answer) {
    const card = answerBars(qid, answer);
    const evidence = evidenceList(qid, answer.x_evidence);
    if (evidence) card.append(evidence);
    return card;
  }

  function answerBars(qid, answer) {
    const card = h("section", { class: "answer", "aria-label": "Answer to " + qid }, h("h3", { text: qid }));
    if (answer.type === "noul") {
      const p = answer.noul;
      const pFalse = Math.round((1 - p) * 10000) / 10000;
      card.append(
        h("p", { class: "summary" }, "yes/no · answer ", h("strong", { text: p >= 0.5 ? "true" : "false" })),
        bar(qid, "true", p, p >= pFalse),
        bar(qid, "false", pFalse, pFalse > p),
      );
      return card;
    }
    const probs = answer.probabilities || {};
    const best = Math.max(...Object.values(probs));
    const headline = answer.type === "choice" ? answer.choice : String(answer.score);
    card.append(h("p", { class: "summary" }, answer.type + " · answer ", h("strong", { text: headline }),
      " · confidence " + answer.confidence));
    const legend = answer.legend || {};
    for (const [optionId, p] of Object.entries(probs)) {
      const description = answer.type === "score" && legend[optionId] !== undefined ? asText(legend[optionId]) : "";
      card.append(bar(qid, optionId, p, p === best, description ? optionId + " · " + description : optionId));
    }
    return card;
  }

  function renderAnswers(body, response, elapsed, sent) {
    $("results-empty").hidden = true;
    const usage = body.usage || {};
    const rows = [
      ["Classifier", body.x_classifier ? body.x_classifier.name + " v" + body.x_classifier.version : undefined],
      ["Model", body.model],
      ["Input tokens", usage.input_tokens],
      ["Round trip", formatMs(elapsed)],
      ["Request id", response.headers.get("x-request-id")],
    ];
    showUsage($("usage"), rows);
    showEvidence($("evidence"), body, typeof sent.state === "string" ? sent.state : undefined, []);
    $("answers").replaceChildren(
      ...Object.entries(body.answers || {}).map(([qid, answer]) => answerCard(qid, answer)),
    );
  }

  // -------------------------------------------------------------------------------------------- wiring

  function wire() {
    $("explain-controls").append(explain.element);
    bindApiKey($("api-key"), "change", loadList);
    $("reload").addEventListener("click", loadList);
    $("classifier").addEventListener("change", showDetails);
    $("run").addEventListener("click", run);
    document.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        run();
      }
    });
    fetchStatus().then(showBanner).catch(() => {});
  }

  wire();
  loadList().then(() => {
    document.body.dataset.ready = "true";
  });
})();
