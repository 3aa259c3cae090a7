// The status page: reads /status.json every 2 seconds and fills in the figures.
"use strict";

(function () {
  const { formatBytes, formatMs, percent, fetchStatus, showBanner } = window.Clef;
  const REFRESH_MS = 2000;

  function set(id, value) {
    const el = document.getElementById(id);
    const text = value === null || value === undefined || value === "" ? "-" : String(value);
    if (el.textContent !== text) el.textContent = text;
  }

  function uptime(seconds) {
    const s = Math.floor(seconds);
    const parts = [];
    if (s >= 3600) parts.push(Math.floor(s / 3600) + " h");
    if (s >= 60) parts.push(Math.floor((s % 3600) / 60) + " min");
    parts.push((s % 60) + " s");
    return parts.join(" ");
  }

  function fusedKernels(fused) {
    if (!fused) return null;
    return fused.in_use ? "in use" : "not in use (" + fused.reason.replace(/_/g, " ") + ")";
  }

  function cell(text) {
    const td = document.createElement("td");
    td.textContent = text;
    return td;
  }

  function renderAnswers(rows) {
    const body = document.getElementById("s-answers");
    const fresh = (rows || []).map((row) => {
      const tr = document.createElement("tr");
      tr.append(
        cell(row.classifier === null ? "(none)" : row.classifier),
        cell(String(row.answers)),
        cell(String(row.near_ties)),
        cell(row.mean_confidence === null ? "-" : row.mean_confidence.toFixed(3)),
      );
      return tr;
    });
    body.replaceChildren(...fresh);
  }

  function render(status) {
    showBanner(status);
    set("s-model", status.model);
    set("s-state", status.state);
    set("s-untrained", status.untrained === null ? null : status.untrained ? "no (random weights)" : "yes");
    set("s-device", status.device);
    set("s-fused", fusedKernels(status.fused_kernels));
    set("s-weights", status.weights);
    set("s-dtype", status.compute_dtype);
    set("s-limit", status.max_input_tokens === null ? null : status.max_input_tokens + " tokens");
    set("s-auth", status.auth ? "required" : "off");
    set("s-version", status.version);
    set("s-uptime", uptime(status.uptime_s));
    const requests = status.requests;
    set("s-queue", status.queue_depth);
    set("s-requests", requests.total);
    set("s-rejected", requests.rejected);
    set("s-errors", requests.errors);
    set("s-p50", formatMs(requests.p50_ms));
    set("s-p95", formatMs(requests.p95_ms));
    set("s-window", requests.window
      ? "Latency over the last " + requests.window + " successful decision requests (arrival to answer)."
      : "No successful decision request yet.");
    const cache = status.state_cache;
    set("s-hit-rate", cache && cache.hit_rate !== null ? percent(cache.hit_rate) : null);
    set("s-hits", cache ? (cache.hits ?? 0) + " / " + (cache.misses ?? 0) : null);
    set("s-entries", cache ? cache.entries : null);
    set("s-bytes", cache ? formatBytes(cache.bytes) + " of " + formatBytes(cache.capacity_bytes) : null);
    set("s-saved", cache ? cache.tokens_saved : null);
    renderAnswers(status.answers);
  }

  async function refresh() {
    const error = document.getElementById("status-error");
    try {
      render(await fetchStatus());
      error.hidden = true;
      document.getElementById("updated").textContent = "Updated " + new Date().toLocaleTimeString();
    } catch (exc) {
      error.hidden = false;
      error.textContent = "Could not read the server's status: " + exc.message;
    }
  }

  refresh();
  setInterval(refresh, REFRESH_MS);
})();
