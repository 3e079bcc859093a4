/* Job page: held-out evaluations, next to the loss chart. Once the job has succeeded, the
 * card shows its newest evaluation as "base → fine-tuned" ("parent → fine-tuned" for a job
 * that continues a fine-tuned model; the grader's mean score, the grader, the rows and the
 * file), every evaluation in a table, the newest finished one's sample answers side by side,
 * and a form that starts one on a processed file (the job's validation file first).
 *
 * The calls are the public API's (GET/POST /v1/fine_tuning/jobs/{id}/evaluations) with the
 * session cookie. An evaluation runs in the background: the list is read every 2 s while
 * one is queued or running, and every 10 s otherwise, so an evaluation started elsewhere
 * (the demo, the CLI) shows without a click.
 */
(function () {
  "use strict";
  const card = document.getElementById("card-evaluations");
  if (!card) return;
  const { api, apiAll, el, pill, progressBar, every } = tf;
  const base = `/v1/fine_tuning/jobs/${encodeURIComponent(tf.page().job_id)}/evaluations`;
  const UNDER_WAY = new Set(["queued", "running"]);
  const IDLE_POLL_MS = 10000;
  // Graders whose rewards are fractions (0..1), shown as percentages (api/evaluations/results.py).
  const FRACTION_GRADERS = new Set(["string_check", "text_similarity"]);

  const form = document.getElementById("ev-form");
  const fileSelect = document.getElementById("ev-file");
  const maxSamples = document.getElementById("ev-max-samples");
  const startButton = document.getElementById("ev-start");
  const formError = document.getElementById("ev-error");

  let job = null;
  let evaluations = [];
  let lastRead = 0;
  let polling = null;

  // A job that continues a fine-tuned model (its model is not its base model) is compared
  // with that model, its parent: the evaluation's "base" side answers as the parent.
  const startLabel = () => (job && job.model !== job.base_model ? "parent" : "base");

  document.addEventListener("tf:job", (event) => {
    job = event.detail;
    for (const th of card.querySelectorAll('[data-role="start-label"]')) {
      th.textContent = startLabel() === "parent" ? "Parent" : "Base";
    }
    if (job?.status !== "succeeded" || polling) return;
    card.classList.remove("hidden");
    loadFiles().catch(() => {}); // api() showed any outage
    polling = every(2000, async () => {
      if (!evaluations.some((e) => UNDER_WAY.has(e.status)) && Date.now() - lastRead < IDLE_POLL_MS) return;
      await refresh();
    });
  });

  // ---- reading --------------------------------------------------------------------------

  async function refresh() {
    lastRead = Date.now();
    evaluations = await apiAll(`${base}?limit=100`, 100);
    render();
  }

  function graderLabel(grader) {
    return grader.type === "string_check" && grader.name === "exact_match" ? "exact match" : grader.name || grader.type;
  }

  function score(evaluation, value) {
    if (value === null || value === undefined) return "—";
    if (FRACTION_GRADERS.has(evaluation.grader.type)) return `${Number((100 * value).toFixed(1))}%`;
    return Number(value).toFixed(3);
  }

  function render() {
    card.dataset.count = String(evaluations.length);
    renderLatest(evaluations[0]);
    const body = document.querySelector("#ev-table tbody");
    body.replaceChildren(...evaluations.map((e) => el("tr", { "data-id": e.id, "data-status": e.status,
      title: `${e.id} on ${e.file}` },
      el("td", pill(e.status), el("div.cell-sub", graderLabel(e.grader))),
      el("td.num", e.results ? e.results.fine_tuned.count : e.max_samples),
      el("td.num", { "data-role": "base" }, score(e, e.results?.base.score)),
      el("td.num", { "data-role": "fine-tuned" }, score(e, e.results?.fine_tuned.score)))));
    renderSamples(evaluations.find((e) => e.status === "succeeded"));
  }

  function renderLatest(e) {
    const box = document.getElementById("ev-latest");
    if (!e) {
      box.replaceChildren(el("p.muted.small", "Not evaluated yet: pick a held-out file below. Both models answer each "
        + "row greedily and the grader compares the answers with the row's last assistant turn."));
      return;
    }
    box.dataset.id = e.id;
    box.dataset.status = e.status;
    const what = `${graderLabel(e.grader)} · ${e.results ? e.results.fine_tuned.count : e.max_samples} rows · ${e.file}`;
    if (e.status === "succeeded") {
      const r = e.results;
      const errors = r.base.errors + r.fine_tuned.errors;
      box.replaceChildren(
        el("div.ev-scores",
          el("div", el("span.who", startLabel()), el("span.score", { "data-role": "base" }, score(e, r.base.score))),
          el("span.arrow", "→"),
          el("div", el("span.who", "fine-tuned"), el("span.score.tuned", { "data-role": "fine-tuned" },
            score(e, r.fine_tuned.score)))),
        el("div.small.muted", what, errors ? ` · ${errors} rows without an answer or a grade` : ""));
    } else if (e.status === "failed") {
      box.replaceChildren(el("div.small", pill("failed"), " ", el("code", e.error?.code || ""), " ",
        e.error?.message || ""), el("div.small.muted", what));
    } else {
      box.replaceChildren(el("div.small", pill(e.status), ` answered ${e.progress.answered} of ${e.progress.total}`),
        progressBar(e.progress.answered, e.progress.total), el("div.small.muted", what));
    }
  }

  function renderSamples(e) {
    const box = document.getElementById("ev-samples-box");
    box.classList.toggle("hidden", !e?.samples?.length);
    if (!e?.samples?.length) return;
    const answer = (a) => el(`div.ev-answer.${a.reward > 0 ? "right" : "wrong"}`,
      { title: `${a.answer ?? ""}\n(${a.error || `reward ${a.reward}`})` }, a.answer ?? `(${a.error || "no answer"})`);
    document.querySelector("#ev-samples tbody").replaceChildren(...e.samples.map((s) => el("tr",
      el("td", el("div.small", s.prompt)), el("td", el("div.ev-answer", s.reference ?? "—")),
      el("td", { "data-role": "base" }, answer(s.base)),
      el("td", { "data-role": "fine-tuned" }, answer(s.fine_tuned)))));
  }

  /** The organization's processed files, the job's validation file first (then the newest). */
  async function loadFiles() {
    const files = (await apiAll("/v1/files?purpose=fine-tune&limit=100", 100)).filter((f) => f.status === "processed");
    files.sort((a, b) => (b.id === job.validation_file) - (a.id === job.validation_file));
    fileSelect.replaceChildren(...files.map((f) => el("option", { value: f.id },
      `${f.filename} · ${f.id}${f.id === job.validation_file ? " (validation file)" : ""}`)));
    startButton.disabled = !files.length;
    if (!files.length) formError.textContent = "Upload a file of held-out rows first (Files, or the new-job form).";
  }

  // ---- starting one -------------------------------------------------------------------------

  async function start() {
    formError.textContent = "";
    const body = { file: fileSelect.value };
    const rows = maxSamples.value.trim();
    if (rows) {
      if (!/^[1-9][0-9]*$/.test(rows)) { formError.textContent = "Rows must be a whole number, or empty for all."; return; }
      body.max_samples = Number(rows);
    }
    startButton.disabled = true;
    try {
      evaluations.unshift(await api(base, { method: "POST", json: body }));
      render();
    } catch (err) {
      if (err instanceof tf.ApiError) formError.textContent = `${err.message}${err.code ? ` (${err.code})` : ""}`;
    } finally {
      startButton.disabled = false;
    }
  }

  form.addEventListener("submit", (event) => { event.preventDefault(); start(); });
})();
