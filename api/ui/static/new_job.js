/* New job page: upload + inline validation, model/method/hyperparameters, the resolved
 * "auto" values, a placement estimate (POST /v1/fine_tuning/estimate) and submit.
 * The training method is supervised or DPO; a DPO job's hyperparameters (beta besides the
 * others) go in OpenAI's method.dpo.hyperparameters, as the API takes no top-level ones
 * for it. Reinforcement is not offered: the API refuses it until a trainer runs it.
 * Everything goes through the public JSON API with the session cookie + CSRF header,
 * except the "auto" preview, which the dashboard's own endpoint computes with the
 * API's resolver (api/hyperparameters.py) so the numbers are the ones the job will get.
 */
(function () {
  "use strict";
  const { api, apiAll, el, fmt, notice } = tf;
  const form = document.getElementById("job-form");
  const statusBox = document.getElementById("file-status");
  const fileSelect = document.getElementById("file-select");
  const validationSelect = document.getElementById("validation-select");
  const submitButton = document.getElementById("submit-job");
  const files = new Map();
  let estimateAvailable = true;

  // ---- files --------------------------------------------------------------------------

  function fileLabel(f) {
    const v = f.validation || {};
    const n = v.n_examples !== undefined && v.n_examples !== null ? ` · ${fmt.num(v.n_examples)} examples` : "";
    return `${f.filename} (${f.id.slice(0, 14)}…${v.format ? ` · ${v.format}` : ""}${n})`;
  }

  async function loadFiles(selectId) {
    const items = await apiAll("/v1/files?purpose=fine-tune&limit=100", 300);
    for (const f of items) files.set(f.id, f);
    const processed = items.filter((f) => f.status === "processed");
    const keepTrain = selectId || fileSelect.value;
    const keepValid = validationSelect.value;
    fileSelect.replaceChildren(el("option", { value: "" }, processed.length ? "Choose a file" : "No validated files yet"),
      ...processed.map((f) => el("option", { value: f.id }, fileLabel(f))));
    validationSelect.replaceChildren(el("option", { value: "" }, "None"),
      ...processed.map((f) => el("option", { value: f.id }, fileLabel(f))));
    if (keepTrain && processed.some((f) => f.id === keepTrain)) fileSelect.value = keepTrain;
    if (keepValid && processed.some((f) => f.id === keepValid)) validationSelect.value = keepValid;
  }

  function showProblems(file) {
    const v = file.validation || {};
    const problems = v.errors || [];
    const box = notice("error", `${file.filename} has ${fmt.num(v.n_errors ?? problems.length)} problem${(v.n_errors ?? problems.length) === 1 ? "" : "s"} — nothing was queued`, null);
    box.setAttribute("data-testid", "validation-errors");
    if (problems.length) {
      box.append(el("ul.problems", problems.map((p) => el("li", { "data-line": p.line ?? "" },
        el("span.line", p.line ? `line ${p.line}` : "file"), el("span.code", p.code), el("span", p.message)))));
      if ((v.n_errors || 0) > problems.length) box.append(el("div.small", { style: "margin-top:6px" }, `…and ${v.n_errors - problems.length} more.`));
    } else {
      box.append(el("div", file.status_details || "The file could not be validated."));
    }
    box.append(el("div.small", { style: "margin-top:8px" }, "Fix these lines and upload the file again."));
    statusBox.replaceChildren(box);
  }

  function showValid(file) {
    const v = file.validation || {};
    const box = notice("ok", `${file.filename} is valid`, null);
    box.setAttribute("data-testid", "validation-ok");
    box.append(el("div", `${v.format ? `Format ${v.format} · ` : ""}${fmt.num(v.n_examples)} examples · ≈ ${fmt.num(v.n_tokens_estimate)} tokens · ${fmt.bytes(file.bytes)}`));
    statusBox.replaceChildren(box);
  }

  async function waitForValidation(fileId) {
    const started = Date.now();
    for (;;) {
      const file = await api(`/v1/files/${encodeURIComponent(fileId)}`);
      files.set(file.id, file);
      if (file.status === "processed") return file;
      if (file.status === "error") return file;
      if (Date.now() - started > 120000) throw new Error("validation is taking longer than two minutes");
      await new Promise((r) => setTimeout(r, 400));
    }
  }

  async function upload(input) {
    const chosen = input.files[0];
    if (!chosen) return;
    statusBox.replaceChildren(notice("info", `Uploading ${chosen.name}…`, `${fmt.bytes(chosen.size)}`));
    const body = new FormData();
    body.append("purpose", "fine-tune");
    body.append("file", chosen, chosen.name);
    let file;
    try {
      file = await api("/v1/files", { method: "POST", form: body });
    } catch (err) {
      const box = notice("error", `${chosen.name} was refused`, `${err.message}${err.code ? ` (${err.code})` : ""}`);
      box.setAttribute("data-testid", "validation-errors");
      statusBox.replaceChildren(box);
      return;
    } finally {
      input.value = "";
    }
    statusBox.replaceChildren(notice("info", `Validating ${file.filename}…`, "Checking every line of the file."));
    try {
      file = await waitForValidation(file.id);
    } catch (err) {
      statusBox.replaceChildren(notice("error", "Validation did not finish", String(err.message || err)));
      return;
    }
    if (file.status === "error") {
      showProblems(file);
      return;
    }
    await loadFiles(file.id);
    fileSelect.value = file.id;
    showValid(file);
    changed();
  }

  // ---- body ---------------------------------------------------------------------------

  function numberField(name) {
    const v = form.elements[name].value.trim();
    return v === "" ? null : Number(v);
  }

  const isDpo = () => form.elements.training_method.value === "dpo";

  /** The hyperparameters from the form: OpenAI's (each a value or "auto"), beta for DPO. */
  function hyperparameters() {
    const hp = {};
    for (const name of ["n_epochs", "batch_size"]) { const v = numberField(name); hp[name] = v === null ? "auto" : Math.round(v); }
    const mult = numberField("learning_rate_multiplier");
    hp.learning_rate_multiplier = mult === null ? "auto" : mult;
    const maxSteps = numberField("max_steps");
    if (maxSteps !== null) hp.max_steps = Math.round(maxSteps);
    if (isDpo()) { const beta = numberField("beta"); hp.beta = beta === null ? "auto" : beta; }
    return hp;
  }

  /** What the form cannot send as it is, or null. */
  function formProblem() {
    const beta = numberField("beta");
    if (isDpo() && beta !== null && !(beta > 0 && beta <= 2)) return "Beta must be above 0 and at most 2, or empty for auto.";
    return null;
  }

  /** The job-creation body (OpenAI fields + our extensions) from the form. */
  function body() {
    const method = form.elements.method.value;
    const hp = hyperparameters();
    const out = {
      model: form.elements.model.value,
      training_file: fileSelect.value,
      // A DPO job takes its hyperparameters in the method only (the API refuses both).
      ...(isDpo() ? { method: { type: "dpo", dpo: { hyperparameters: hp } } } : { hyperparameters: hp }),
      adapter: {
        method,
        r: Math.round(numberField("r") ?? 8),
        alpha: numberField("alpha") ?? 16,
        ...(method === "qlora" ? { quantization: form.elements.quantization.value } : {}),
      },
      trainer: form.elements.trainer.value,
      priority: form.elements.priority.value,
    };
    if (validationSelect.value) out.validation_file = validationSelect.value;
    const pool = form.elements.pool.value;
    if (pool) out.placement = { pool };
    const seq = numberField("max_seq_len");
    if (seq !== null) out.max_seq_len = Math.round(seq);
    const suffix = form.elements.suffix.value.trim();
    if (suffix) out.suffix = suffix;
    return out;
  }

  const ready = () => Boolean(fileSelect.value && form.elements.model.value);

  // ---- resolved "auto" values ---------------------------------------------------------

  async function resolveAuto() {
    const targets = document.querySelectorAll("[data-resolved]");
    if (!fileSelect.value) { targets.forEach((t) => { t.textContent = ""; }); return; }
    const hp = hyperparameters();
    const params = new URLSearchParams({ training_file: fileSelect.value, method: isDpo() ? "dpo" : "supervised" });
    for (const [k, v] of Object.entries(hp)) params.set(k, String(v));
    try {
      const r = await api(`/ui/api/hyperparameters?${params}`);
      const mark = (name, text) => { document.querySelector(`[data-resolved="${name}"]`).textContent = text; };
      const got = r.hyperparameters;
      mark("n_epochs", hp.n_epochs === "auto" ? `auto → ${got.n_epochs}` : "");
      mark("batch_size", hp.batch_size === "auto" ? `auto → ${got.batch_size}` : "");
      mark("learning_rate", `learning rate ${fmt.sci(got.learning_rate)}`);
      mark("total_steps", `${fmt.num(got.total_steps)} optimizer steps for ${fmt.num(r.n_examples)} examples`);
      mark("beta", hp.beta === "auto" ? `auto → ${got.beta}` : "");
    } catch (_) {
      targets.forEach((t) => { t.textContent = ""; });
    }
  }

  // ---- estimate -----------------------------------------------------------------------

  function poolRows(result) {
    return result.pools || result.data || result.estimates || [];
  }

  function renderEstimate(result) {
    const box = document.getElementById("estimate");
    const pools = poolRows(result);
    const chosen = result.chosen || result.placement || pools.find((p) => p.pool === result.pool) || null;
    const parts = [];
    if (chosen && (chosen.fits ?? true) && chosen.pool) {
      const pick = notice("ok", null, null);
      pick.setAttribute("data-testid", "estimate-choice");
      const unit = tf.devices(chosen.accelerator || pools.find((p) => p.pool === chosen.pool)?.accelerator);
      pick.append(el("div", el("b", `${chosen.gpus}× ${unit.one} on pool `), el("span.tag", chosen.pool),
        chosen.trainer ? [" · trainer ", el("span.tag", chosen.trainer)] : null));
      pick.append(el("div.small", { style: "margin-top:4px" },
        `ETA ${fmt.duration(chosen.eta_s)} · ${fmt.num(chosen.tokens_per_s)} tokens/s · cost ${fmt.money(chosen.cost)}`));
      parts.push(pick);
    } else {
      const reasons = result.reasons || (chosen && chosen.reasons) || [];
      const warn = notice("warn", "No pool can hold this job", null);
      warn.setAttribute("data-testid", "estimate-choice");
      if (reasons.length) warn.append(el("ul.reasons", reasons.map((r) => el("li", r))));
      parts.push(warn);
    }
    const unit = tf.devices(pools.map((p) => p.accelerator));
    parts.push(el("h3", { style: "margin-top:14px" }, `Memory per ${unit.one} vs capacity`));
    for (const p of pools) {
      const need = p.memory_per_gpu_bytes;
      const cap = p.gpu_memory_bytes;
      const scale = Math.max(cap || 1, need || 0);
      const fill = el(`div.fill${p.fits ? ".ok" : ".over"}`, { style: `width:${need ? Math.min(100, (100 * need) / scale) : 0}%` });
      const capMark = el("div.cap", { style: `left:calc(${(100 * cap) / scale}% - 1px)`, title: "GPU memory" });
      parts.push(el("div.meter-row", { "data-pool": p.pool },
        el("div", el("div.name", p.pool), el("div.cell-sub", p.fits
          ? `${p.gpus}× ${tf.devices(p.accelerator).one}${p.cpu_offload ? " + CPU offload" : ""}` : "does not fit")),
        el("div.meter", fill, capMark),
        el("div.fig", need ? `${fmt.bytes(need)} / ${fmt.bytes(cap)}` : "—")));
      if (p.reasons?.length && !p.fits) parts.push(el("div.cell-sub", { style: "margin:-4px 0 6px 182px" }, p.reasons.join("; ")));
    }
    box.replaceChildren(...parts);
    document.getElementById("estimate-when").textContent = `updated ${new Date().toLocaleTimeString("en-GB")}`;
  }

  let estimateSeq = 0;
  async function estimate() {
    const box = document.getElementById("estimate");
    if (!estimateAvailable) return;
    if (!ready()) {
      box.replaceChildren(el("div.muted", "Choose a training file and a model to see where this job fits."));
      return;
    }
    const problem = formProblem();
    if (problem) { box.replaceChildren(notice("warn", "No estimate for these settings", problem)); return; }
    const seq = ++estimateSeq;
    box.style.opacity = "0.6";
    try {
      const result = await api("/v1/fine_tuning/estimate", { method: "POST", json: body() });
      if (seq === estimateSeq) renderEstimate(result);
    } catch (err) {
      if (seq !== estimateSeq) return;
      if (err instanceof tf.ApiError && (err.status === 404 || err.status === 405) && (!err.code || err.code === "not_found" || err.code === "method_not_allowed")) {
        estimateAvailable = false;
        const na = el("div.unavailable", { "data-testid": "estimate-unavailable" },
          "Estimates are not available on this server (no POST /v1/fine_tuning/estimate). The scheduler still places the job.");
        box.replaceChildren(na);
      } else if (err instanceof tf.ApiError) {
        box.replaceChildren(notice("warn", "No estimate for these settings", `${err.message}${err.param ? ` (${err.param})` : ""}`));
      }
    } finally {
      box.style.opacity = "";
    }
  }

  // ---- submit -------------------------------------------------------------------------

  async function submit() {
    const errors = document.getElementById("submit-errors");
    errors.replaceChildren();
    const problem = formProblem();
    if (problem) {
      const box = notice("error", "The job was not created", problem);
      box.setAttribute("data-testid", "submit-error");
      errors.replaceChildren(box);
      return;
    }
    submitButton.disabled = true;
    try {
      const job = await api("/v1/fine_tuning/jobs", { method: "POST", json: body() });
      location.href = `/ui/jobs/${encodeURIComponent(job.id)}`;
    } catch (err) {
      submitButton.disabled = false;
      const box = notice("error", "The job was not created", `${err.message}${err.param ? ` — field ${err.param}` : ""}`);
      box.setAttribute("data-testid", "submit-error");
      errors.replaceChildren(box);
    }
  }

  // ---- wiring -------------------------------------------------------------------------

  let timer = null;
  function changed() {
    submitButton.disabled = !ready();
    document.getElementById("quant-field").classList.toggle("hidden", form.elements.method.value !== "qlora");
    document.getElementById("dpo-fields").classList.toggle("hidden", !isDpo());
    document.getElementById("preference-help").classList.toggle("hidden", !isDpo());
    clearTimeout(timer);
    timer = setTimeout(() => { resolveAuto(); estimate(); }, 250);
  }

  document.getElementById("upload-input").addEventListener("change", (e) => upload(e.target));
  fileSelect.addEventListener("change", () => {
    const f = files.get(fileSelect.value);
    if (f) showValid(f); else statusBox.replaceChildren();
    changed();
  });
  form.addEventListener("input", (e) => { if (e.target.type !== "file") changed(); });
  form.addEventListener("change", (e) => { if (e.target.type !== "file" && e.target !== fileSelect) changed(); });
  submitButton.addEventListener("click", submit);

  (async () => {
    const models = document.getElementById("model-select");
    try {
      const list = await api("/v1/models");
      const bases = (list.data || []).filter((m) => !String(m.id).startsWith("ft:"));
      models.replaceChildren(el("option", { value: "" }, bases.length ? "Choose a base model" : "No base models configured"),
        ...bases.map((m) => el("option", { value: m.id }, m.id)));
      if (bases.length === 1) models.value = bases[0].id;
    } catch (_) {
      models.replaceChildren(el("option", { value: "" }, "Models unavailable"));
    }
    try {
      const pools = await api("/v1/node_pools");
      const select = document.getElementById("pool-select");
      for (const p of pools.data || []) select.append(el("option", { value: p.name }, `${p.name} (${p.accelerator})`));
    } catch (_) { /* no pool listing: the scheduler still picks one */ }
    await loadFiles();
    changed();
  })();
})();
