/* Job page playground: once a job has succeeded, send one prompt to its fine-tuned model
 * (the final adapter or any checkpoint) and, in "compare with the base model" mode (on by
 * default), to its base model at once, and stream both answers side by side. An optional
 * system prompt goes first, as a system message; the temperature starts at 0 (greedy), so
 * the two columns differ by the model, not by sampling.
 *
 * Both requests are ordinary POST /v1/chat/completions calls with `stream: true`, made
 * with the dashboard's session cookie and CSRF token, so the API applies the same tenant
 * check and admission limits as for an API key. The Server-Sent Events are read from the
 * fetch body (EventSource cannot POST): OpenAI's `chat.completion.chunk` objects, an
 * `{"error": ...}` object if the generation fails mid-stream, and `data: [DONE]` last.
 *
 * Errors per column: 429 says when to retry (Retry-After), 503 `model_loading` waits
 * Retry-After and tries again (the first request after a start loads the base model),
 * anything else shows the API's message.
 */
(function () {
  "use strict";
  const card = document.getElementById("playground");
  if (!card) return;
  const { el } = tf;
  const jobId = tf.page().job_id;

  // A base model loads in seconds to minutes; stop retrying after about five minutes.
  const MAX_LOADING_RETRIES = 150;

  const form = document.getElementById("pg-form");
  const modelSelect = document.getElementById("pg-model");
  const promptBox = document.getElementById("pg-prompt");
  const systemBox = document.getElementById("pg-system");
  const sendButton = document.getElementById("pg-send");
  const stopButton = document.getElementById("pg-stop");
  const formError = document.getElementById("pg-form-error");
  const compare = document.getElementById("pg-compare");

  let baseModel = null;
  let controller = null;

  /** One answer column: its output box, its status line and data-* state for tests. */
  function column(id) {
    const node = document.getElementById(id);
    const output = node.querySelector('[data-role="output"]');
    const status = node.querySelector('[data-role="status"]');
    const modelLabel = node.querySelector('[data-role="model"]');
    return {
      node,
      reset(model) {
        output.textContent = "";
        modelLabel.textContent = model;
        node.dataset.model = model;
        node.dataset.loadingRetries = "0";
        delete node.dataset.code;
        this.state("waiting", "Waiting for the first token…");
      },
      append(text) { output.textContent += text; output.scrollTop = output.scrollHeight; },
      text() { return output.textContent; },
      state(state, message, tone = "") {
        node.dataset.state = state;
        status.className = `pg-status small ${tone || "muted"}`;
        status.textContent = message;
      },
      fail(message, code) {
        if (code) node.dataset.code = code;
        this.state("error", message, "error");
      },
      loading(seconds) {
        node.dataset.loadingRetries = String(Number(node.dataset.loadingRetries || 0) + 1);
        this.state("loading", `Model loading, retrying in ${seconds} s…`, "warn");
      },
    };
  }

  const columns = { tuned: column("pg-col-tuned"), base: column("pg-col-base") };

  /** Without the comparison, the fine-tuned model's column takes the whole width. */
  function showComparison() {
    columns.base.node.classList.toggle("hidden", !compare.checked);
    document.getElementById("pg-columns").classList.toggle("single", !compare.checked);
  }
  compare.addEventListener("change", showComparison);

  // ---- models -------------------------------------------------------------------------

  document.addEventListener("tf:job", (event) => {
    const job = event.detail;
    if (baseModel !== null || job?.status !== "succeeded" || !job.fine_tuned_model) return;
    baseModel = job.model;
    card.classList.remove("hidden");
    fillModels(job, []);
    tf.apiAll(`/v1/fine_tuning/jobs/${encodeURIComponent(jobId)}/checkpoints?limit=100`, 1000)
      .then((checkpoints) => fillModels(job, checkpoints))
      .catch(() => {}); // the final model stays selectable; api() showed any outage
  });

  /** The final model first, then the checkpoints, newest first (each is a model id). */
  function fillModels(job, checkpoints) {
    const selected = modelSelect.value;
    const options = [el("option", { value: job.fine_tuned_model }, `final · ${job.fine_tuned_model}`)];
    for (const c of [...checkpoints].sort((a, b) => b.step_number - a.step_number)) {
      const id = c.fine_tuned_model_checkpoint;
      if (!id || id === job.fine_tuned_model) continue;
      options.push(el("option", { value: id, "data-step": c.step_number }, `step ${c.step_number} · ${id}`));
    }
    modelSelect.replaceChildren(...options);
    if (options.some((o) => o.value === selected)) modelSelect.value = selected;
  }

  // ---- settings -----------------------------------------------------------------------

  /** The request's sampling settings, or {error} naming the field to fix. */
  function readSettings() {
    const number = (id) => {
      const raw = document.getElementById(id).value.trim();
      return raw === "" ? null : Number(raw);
    };
    const prompt = promptBox.value;
    if (!prompt.trim()) return { error: "Write a prompt first." };
    const temperature = number("pg-temperature");
    if (temperature === null || !(temperature >= 0 && temperature <= 2)) {
      return { error: "Temperature must be a number from 0 (greedy) to 2." };
    }
    const maxTokens = number("pg-max-tokens");
    if (!Number.isInteger(maxTokens) || maxTokens < 1 || maxTokens > 4096) {
      return { error: "Max tokens must be a whole number from 1 to 4096." };
    }
    const topP = number("pg-top-p");
    if (topP === null || !(topP > 0 && topP <= 1)) return { error: "top_p must be above 0 and at most 1." };
    const seed = number("pg-seed");
    if (seed !== null && !Number.isSafeInteger(seed)) return { error: "Seed must be a whole number, or empty." };
    const system = systemBox.value;
    const messages = system.trim() ? [{ role: "system", content: system }] : [];
    messages.push({ role: "user", content: prompt });
    const settings = { messages, temperature, max_tokens: maxTokens, top_p: topP };
    if (seed !== null) settings.seed = seed;
    return { settings };
  }

  // ---- requests -----------------------------------------------------------------------

  const sleep = (ms, signal) => new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(timer); reject(new DOMException("stopped", "AbortError")); },
      { once: true });
  });

  function retryAfter(response, fallback) {
    const seconds = Number(response.headers.get("Retry-After"));
    return Number.isFinite(seconds) && seconds > 0 ? Math.ceil(seconds) : fallback;
  }

  async function errorOf(response) {
    const text = await response.text();
    try {
      const err = JSON.parse(text).error || {};
      return { message: err.message || `HTTP ${response.status}`, code: err.code || null };
    } catch (_) {
      return { message: text.slice(0, 300) || `HTTP ${response.status}`, code: null };
    }
  }

  /** Stream one completion of `model` into `col`, retrying while the model loads. */
  async function complete(col, model, settings, signal) {
    col.reset(model);
    for (let attempt = 0; ; attempt += 1) {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        credentials: "same-origin",
        signal,
        headers: { "Content-Type": "application/json", Accept: "text/event-stream", "X-CSRF-Token": tf.csrfToken() },
        body: JSON.stringify({ model, ...settings, stream: true, stream_options: { include_usage: true } }),
      });
      if (response.ok) return readStream(response, col);
      const err = await errorOf(response);
      if (response.status === 401) {
        window.location.href = "/ui/login?next=" + encodeURIComponent(location.pathname + location.search);
        return undefined;
      }
      if (response.status === 429) {
        col.fail(`Too many requests, retry in ${retryAfter(response, 1)} s. ${err.message}`, err.code);
        return undefined;
      }
      if (response.status === 503 && err.code === "model_loading" && attempt < MAX_LOADING_RETRIES) {
        const wait = retryAfter(response, 2);
        col.loading(wait);
        await sleep(wait * 1000, signal);
        continue;
      }
      col.fail(`${err.message}${err.code ? ` (${err.code})` : ""}`, err.code);
      return undefined;
    }
  }

  /** Read OpenAI's SSE chunks from the body until `data: [DONE]`. */
  async function readStream(response, col) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let finish = null;
    let usage = null;
    col.state("streaming", "Streaming…");
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const events = buffer.split(/\r?\n\r?\n/);
      buffer = events.pop();
      for (const event of events) {
        const data = event.split(/\r?\n/).filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue;
        if (data === "[DONE]") {
          await reader.cancel();
          const tokens = usage ? `${usage.completion_tokens} tokens` : "done";
          col.state("done", `${tokens}${finish ? ` · finish: ${finish}` : ""}`);
          return;
        }
        let chunk;
        try { chunk = JSON.parse(data); } catch (_) {
          col.fail("The server sent a chunk that is not JSON; the answer is incomplete.");
          await reader.cancel();
          return;
        }
        if (chunk.error) {
          col.fail(`${chunk.error.message || "The generation failed."}${chunk.error.code ? ` (${chunk.error.code})` : ""}`,
            chunk.error.code);
          await reader.cancel();
          return;
        }
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          if (choice.index !== 0) continue;
          if (choice.delta?.content) col.append(choice.delta.content);
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
    col.fail("The stream ended before the answer was complete; send again.");
  }

  async function send() {
    const { settings, error } = readSettings();
    formError.textContent = error || "";
    if (error || !baseModel || !modelSelect.value) return;
    if (controller) controller.abort();
    const mine = new AbortController();
    controller = mine;
    sendButton.disabled = true;
    stopButton.classList.remove("hidden");
    const one = async (col, model) => {
      try {
        await complete(col, model, settings, mine.signal);
      } catch (err) {
        if (err.name === "AbortError") col.state("stopped", "Stopped.");
        else col.fail(`Cannot reach the tunefleet API (${err.message}).`);
      }
    };
    const asked = [one(columns.tuned, modelSelect.value)];
    if (compare.checked) asked.push(one(columns.base, baseModel));
    await Promise.all(asked);
    if (controller === mine) {
      controller = null;
      sendButton.disabled = false;
      stopButton.classList.add("hidden");
    }
  }

  form.addEventListener("submit", (event) => { event.preventDefault(); send(); });
  stopButton.addEventListener("click", () => { if (controller) controller.abort(); });
  promptBox.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); send(); }
  });
})();
