/* Job page: header + actions, live charts over SSE, events, log tail, checkpoints,
 * artifacts. The first paint loads the job, its metric history and events over the JSON
 * API; then one EventSource on /v1/fine_tuning/jobs/{id}/stream appends metric points
 * and events as the trainer reports them (the browser reconnects on its own and sends
 * Last-Event-ID, so nothing is missed or repeated). Job state, checkpoints, artifacts
 * and the log are re-read on a short poll while the job is live.
 */
(function () {
  "use strict";
  const { api, apiAll, el, fmt, pill, progressBar, emptyState, notice, confirmAction, every } = tf;
  const jobId = tf.page().job_id;
  const base = `/v1/fine_tuning/jobs/${encodeURIComponent(jobId)}`;
  const LIVE = new Set(["validating_files", "queued", "running", "paused"]);

  let job = null;
  let lastMetric = null;
  const seenEvents = new Set();

  const charts = {
    loss: tf.lineChart(document.getElementById("chart-loss"), {
      series: [{ label: "train", color: "#4f46e5" }, { label: "valid", color: "#f79009" }],
      yFmt: (v) => Number(v).toFixed(3),
    }),
    lr: tf.lineChart(document.getElementById("chart-lr"), {
      series: [{ label: "learning rate", color: "#12b76a" }], yFmt: (v) => Number(v).toExponential(1),
    }),
    tps: tf.lineChart(document.getElementById("chart-tps"), {
      series: [{ label: "tokens/s", color: "#0ba5ec" }], yFmt: (v) => fmt.num(v),
    }),
    mem: tf.lineChart(document.getElementById("chart-mem"), {
      series: [{ label: "memory", color: "#9e77ed" }], yFmt: (v) => fmt.bytes(v),
      yTick: (v, ticks) => fmt.bytesTick(v, ticks),
      empty: "No memory readings reported yet.",
    }),
    // DPO runs only: their cards show once the job is DPO or a reward metric arrives.
    rewardAccuracy: tf.lineChart(document.getElementById("chart-reward-accuracy"), {
      series: [{ label: "train", color: "#4f46e5" }, { label: "valid", color: "#f79009" }],
      yFmt: (v) => `${(100 * Number(v)).toFixed(1)}%`,
    }),
    rewards: tf.lineChart(document.getElementById("chart-rewards"), {
      series: [{ label: "chosen", color: "#12b76a" }, { label: "rejected", color: "#f04438" },
        { label: "margin", color: "#4f46e5" }, { label: "valid margin", color: "#f79009" }],
      yFmt: (v) => Number(v).toFixed(3),
    }),
    // Reinforcement runs only: shown once a reward metric arrives.
    rlReward: tf.lineChart(document.getElementById("chart-rl-reward"), {
      series: [{ label: "train", color: "#4f46e5" }, { label: "valid", color: "#f79009" }],
      yFmt: (v) => Number(v).toFixed(3),
    }),
    rlPolicy: tf.lineChart(document.getElementById("chart-rl-policy"), {
      series: [{ label: "KL", color: "#12b76a" }, { label: "clipped", color: "#f04438" }],
      yFmt: (v) => Number(v).toFixed(4),
    }),
  };

  // A multi grader's sub-rewards: one series per sub-grader. The names are the job's
  // grader's, the same on every row, so the chart is made from the first row that has them.
  const SUB_REWARD_COLORS = ["#4f46e5", "#12b76a", "#f79009", "#f04438", "#0ba5ec", "#9e77ed", "#ee46bc", "#667085"];
  let subRewardNames = null;
  let subRewardChart = null;

  function addSubRewards(rows) {
    const graded = rows.filter((m) => m.sub_rewards && Object.keys(m.sub_rewards).length);
    if (!graded.length) return;
    if (!subRewardChart) {
      subRewardNames = Object.keys(graded[0].sub_rewards);
      subRewardChart = tf.lineChart(document.getElementById("chart-rl-sub-rewards"), {
        series: subRewardNames.map((name, k) => ({ label: name, color: SUB_REWARD_COLORS[k % SUB_REWARD_COLORS.length] })),
        yFmt: (v) => Number(v).toFixed(3),
      });
      document.getElementById("card-rl-sub-rewards").classList.remove("hidden");
    }
    subRewardChart.setData(graded.map((m) => [m.step, subRewardNames.map((name) => m.sub_rewards[name] ?? null)]));
  }

  // Steps whose grader could not score some completions (they got reward 0): step -> count.
  const graderErrors = new Map();

  function showGraderErrors(rows) {
    for (const m of rows) if (has(m.grader_errors)) graderErrors.set(m.step, m.grader_errors);
    const failing = [...graderErrors].filter(([, n]) => n > 0);
    if (!failing.length) return;
    const total = failing.reduce((sum, [, n]) => sum + n, 0);
    const last = Math.max(...failing.map(([step]) => step));
    const box = document.getElementById("rl-grader-errors");
    box.textContent = `The grader could not score ${fmt.num(total)} completions over ${failing.length} step(s), ` +
      `the last at step ${last}; they got reward 0. The job's events say why.`;
    box.classList.remove("hidden");
  }

  const REWARD_KEYS = ["rewards/accuracy", "rewards/chosen", "rewards/rejected", "rewards/margin",
    "valid_rewards/accuracy", "valid_rewards/margin"];

  function showRewardCharts() {
    for (const id of ["card-reward-accuracy", "card-rewards"]) document.getElementById(id).classList.remove("hidden");
  }

  // ---- metrics ------------------------------------------------------------------------

  const has = (v) => v !== null && v !== undefined;

  /** MFU per step (the share of the gang's peak FLOP/s the model's own FLOPs used, as
   * the API computes it) and the job's mean tokens/s and MFU over its steps. */
  function throughputChart() {
    const chart = tf.lineChart(document.getElementById("chart-mfu"), {
      series: [{ label: "MFU", color: "#ee46bc" }], yFmt: (v) => `${Number(v).toFixed(1)}%`,
      yTick: (v) => `${Number(Number(v).toPrecision(3))}%`,  // small MFUs (CPU slots) keep distinct ticks
      empty: "No MFU reported yet.",
    });
    return {
      addRows(rows) { chart.setData(rows.filter((m) => has(m.mfu)).map((m) => [m.step, [100 * m.mfu]])); },
      showMeans(j) {
        const means = [];
        if (has(j.mean_mfu)) means.push(`mean ${(100 * j.mean_mfu).toFixed(1)}%`);
        if (has(j.mean_tokens_per_s)) means.push(`${fmt.num(j.mean_tokens_per_s)} tokens/s`);
        document.getElementById("throughput-means").textContent = means.join(" · ");
      },
    };
  }
  const throughput = throughputChart();

  /** Add metric rows (any order; a re-sent step replaces its point), redrawing once. */
  function addMetrics(rows) {
    rows = rows.filter((m) => has(m.step));
    if (!rows.length) return;
    throughput.addRows(rows);
    charts.loss.setData(rows.map((m) => [m.step, [m.train_loss, m.valid_loss]]));
    charts.lr.setData(rows.filter((m) => has(m.learning_rate)).map((m) => [m.step, [m.learning_rate]]));
    charts.tps.setData(rows.filter((m) => has(m.tokens_per_s)).map((m) => [m.step, [m.tokens_per_s]]));
    charts.mem.setData(rows.filter((m) => has(m.memory_bytes)).map((m) => [m.step, [m.memory_bytes]]));
    const rewarded = rows.filter((m) => REWARD_KEYS.some((k) => has(m[k])));
    if (rewarded.length) {
      showRewardCharts();
      charts.rewardAccuracy.setData(rewarded.map((m) => [m.step, [m["rewards/accuracy"], m["valid_rewards/accuracy"]]]));
      charts.rewards.setData(rewarded.map((m) => [m.step,
        [m["rewards/chosen"], m["rewards/rejected"], m["rewards/margin"], m["valid_rewards/margin"]]]));
    }
    const sampled = rows.filter((m) => has(m.reward_mean) || has(m.valid_reward_mean));
    if (sampled.length) {
      for (const id of ["card-rl-reward", "card-rl-policy"]) document.getElementById(id).classList.remove("hidden");
      charts.rlReward.setData(sampled.map((m) => [m.step, [m.reward_mean, m.valid_reward_mean]]));
      charts.rlPolicy.setData(sampled.map((m) => [m.step, [m.kl, m.clip_fraction]]));
      addSubRewards(sampled);
      showGraderErrors(sampled);
    }
    for (const m of rows) {
      if (!lastMetric || m.step >= lastMetric.step) lastMetric = { ...(lastMetric || {}), ...m };
    }
    scheduleStats();
  }

  let statsPending = false;
  function scheduleStats() {
    if (statsPending) return;
    statsPending = true;
    requestAnimationFrame(() => {
      statsPending = false;
      document.getElementById("points-loss").textContent = `${charts.loss.count()} points`;
      renderStats();
    });
  }
  const addMetric = (m) => addMetrics([m]);

  /** The whole history, ascending by step; the API pages by the last step seen. */
  async function loadMetrics() {
    let after = null;
    for (let pages = 0; pages < 100; pages += 1) {
      const page = await api(`${base}/metrics?limit=1000${after === null ? "" : `&after=${after}`}`);
      const rows = page.data || [];
      addMetrics(rows);
      if (!page.has_more || !rows.length) return;
      after = rows[rows.length - 1].step;
    }
  }

  // ---- header, stats, details ---------------------------------------------------------

  function renderHeader() {
    const status = document.getElementById("job-status");
    status.replaceChildren(pill(job.status));
    status.dataset.status = job.status;
    const name = job.user_provided_suffix ? `${job.user_provided_suffix} · ` : "";
    if (job.method?.type === "dpo") showRewardCharts();
    document.getElementById("job-subtitle").textContent =
      `${name}${job.model} · created ${fmt.time(job.created_at)}`;

    const show = (id, on) => document.getElementById(id).classList.toggle("hidden", !on);
    show("btn-cancel", LIVE.has(job.status));
    show("btn-pause", job.status === "running" || job.status === "queued");
    show("btn-resume", job.status === "paused");

    const notices = document.getElementById("job-notices");
    notices.replaceChildren();
    if (job.status === "failed") {
      const err = job.error || {};
      const box = notice("error", "This job failed", null);
      box.setAttribute("data-testid", "job-error");
      box.append(el("div", err.code ? el("code", err.code) : null, " ", err.message || "No error message was recorded."));
      notices.append(box);
    } else if (job.status === "queued" || job.status === "validating_files") {
      const box = notice("warn", job.status === "queued" ? "Waiting for capacity" : "Validating files", null);
      box.setAttribute("data-testid", "queue-reason");
      const reasons = [];
      if (job.queue_reason) reasons.push(job.queue_reason);
      const placementReasons = job.estimate?.chosen?.reasons || job.estimate?.reasons || [];
      // The estimate's reasons, unless the scheduler's reason already says them.
      for (const r of placementReasons) if (!reasons.some((q) => q.includes(r))) reasons.push(r);
      if (reasons.length) box.append(el("ul.reasons", reasons.map((r) => el("li", r))));
      else box.append(el("div", job.status === "queued" ? "The scheduler has not placed this job yet." : "The training file is being checked."));
      notices.append(box);
    } else if (job.status === "succeeded") {
      const box = notice("ok", "Training finished", null);
      box.append(el("div", job.fine_tuned_model ? ["Fine-tuned model ", el("code", job.fine_tuned_model), " — download the adapter below."] : "Download the adapter below."));
      notices.append(box);
    } else if (job.status === "cancelled") {
      notices.append(notice("info", "Cancelled", "The job was stopped; checkpoints written before the cancel are kept."));
    } else if (job.status === "paused") {
      notices.append(notice("info", "Paused", "The job stopped at its last checkpoint and resumes from it."));
    }
    if (!LIVE.has(job.status)) {
      for (const empty of document.querySelectorAll(".chart-empty")) empty.textContent = "No data was reported.";
    }
    renderStats();
    renderDetails();
    // The playground (playground.js) follows the job's state without its own polling.
    document.dispatchEvent(new CustomEvent("tf:job", { detail: job }));
  }

  function renderStats() {
    if (!job) return;
    const total = job.total_steps || lastMetric?.total_steps || job.hyperparameters?.total_steps || null;
    const step = Math.max(job.current_step || 0, lastMetric?.step || 0);
    document.getElementById("stat-progress").textContent = total ? `${step} / ${total}` : step ? String(step) : "—";
    document.getElementById("stat-progress-bar").replaceChildren(progressBar(step, total, true));
    document.getElementById("stat-loss").textContent = fmt.loss(lastMetric?.train_loss);
    document.getElementById("stat-valid").textContent =
      lastMetric?.valid_loss !== null && lastMetric?.valid_loss !== undefined ? `valid ${fmt.loss(lastMetric.valid_loss)}` : " ";
    document.getElementById("stat-tps").textContent = fmt.num(lastMetric?.tokens_per_s);
    throughput.showMeans(job);
    const seen = job.trained_tokens || lastMetric?.tokens_seen;
    document.getElementById("stat-tokens").textContent = seen ? `${fmt.num(seen)} tokens seen` : " ";
    const eta = job.estimated_finish && LIVE.has(job.status) ? job.estimated_finish - Date.now() / 1000 : null;
    document.getElementById("stat-eta").textContent = LIVE.has(job.status) ? (eta !== null ? fmt.duration(eta) : "—") : job.status === "succeeded" ? "done" : "—";
    const start = job.started_at;
    const end = job.finished_at || (LIVE.has(job.status) ? Date.now() / 1000 : null);
    document.getElementById("stat-elapsed").textContent =
      start && end ? `${LIVE.has(job.status) ? "running for" : "ran for"} ${fmt.duration(end - start)}` : " ";
  }

  // The accelerator of the job's pool, for its words (a CPU pool's "GPUs" are slots): from
  // the pool rows of the job's estimate, else from GET /v1/node_pools, read once.
  let poolAccelerators = null;
  function acceleratorOf(j) {
    if (!j.pool) return null;
    const row = (j.estimate?.pools || []).find((p) => p.pool === j.pool);
    if (row?.accelerator) return row.accelerator;
    if (poolAccelerators === null) {
      poolAccelerators = new Map();
      api("/v1/node_pools").then((r) => {
        for (const p of r.data || []) poolAccelerators.set(p.name, p.accelerator);
        if (job) renderDetails();
      }).catch(() => {});
    }
    return poolAccelerators.get(j.pool) || null;
  }

  function renderDetails() {
    const hp = job.hyperparameters || {};
    const ad = job.adapter || {};
    const unit = tf.devices(acceleratorOf(job));
    const rows = [
      ["Model", el("span", job.model)],  // a base model, or the fine-tuned model it continues
      ["Method", ad.method ? `${ad.method.toUpperCase()}${ad.quantization && ad.quantization !== "none" ? ` (${ad.quantization})` : ""} · r ${ad.r ?? "—"} · α ${ad.alpha ?? "—"}` : "—"],
      ["Objective", job.method?.type === "dpo" ? `DPO · β ${hp.beta ?? "auto"}` : "Supervised"],
      ["Trainer", job.estimate?.chosen?.trainer || job.trainer || "—"],
      ["Pool", job.pool ? el("span.tag", job.pool) : el("span.muted", "not placed yet")],
      [unit.title, job.gpus ?? "—"],
      ["Priority", job.priority ?? "—"],
      ["Epochs", hp.n_epochs ?? "—"],
      ["Batch size", hp.batch_size ?? "—"],
      ["Learning rate", hp.learning_rate !== undefined ? fmt.sci(hp.learning_rate) : hp.learning_rate_multiplier !== undefined ? `× ${hp.learning_rate_multiplier}` : "—"],
      ["Training file", el("span.mono", job.training_file || "—")],
      ["Validation file", el("span.mono", job.validation_file || "—")],
      ["Seed", job.seed ?? "—"],
    ];
    // A job that continues a fine-tuned model: its model is that model, the lineage's root its base.
    if (job.base_model && job.base_model !== job.model) rows.splice(1, 0, ["Base model", el("span", job.base_model)]);
    if (job.tenant_id && tf.page().principal.is_admin) rows.splice(0, 0, ["Tenant", el("span.mono", job.tenant_id)]);
    if (job.fine_tuned_model) rows.push(["Fine-tuned model", el("span.mono", job.fine_tuned_model)]);
    if (job.usage?.gpu_seconds !== undefined) rows.push([unit.time, fmt.duration(job.usage.gpu_seconds)]);
    if (job.usage?.cost !== undefined && job.usage?.cost !== null) rows.push(["Cost", fmt.money(job.usage.cost)]);
    document.getElementById("job-details").replaceChildren(...rows.flatMap(([k, v]) => [el("dt", k), el("dd", v)]));
  }

  async function loadJob() {
    job = await api(base);
    renderHeader();
  }

  // ---- events -------------------------------------------------------------------------

  /** Newest first. A live event goes above events of the same second; listed history
   *  (already newest first) goes below them. */
  function addEvent(ev, live = true) {
    if (!ev || !ev.id || seenEvents.has(ev.id)) return;
    seenEvents.add(ev.id);
    const list = document.getElementById("events");
    const item = el(`li.${ev.level || "info"}`, { "data-created": ev.created_at },
      el("span.dot"), el("div", el("div", ev.message), el("div.when", fmt.time(ev.created_at))));
    let before = null;
    for (const node of list.children) {
      const t = Number(node.dataset.created);
      if (live ? t <= ev.created_at : t < ev.created_at) { before = node; break; }
    }
    list.insertBefore(item, before);
  }

  async function loadEvents() {
    const page = await api(`${base}/events?limit=100`);
    for (const ev of page.data || []) addEvent(ev, false);
  }

  // ---- checkpoints and artifacts ------------------------------------------------------

  async function loadCheckpoints() {
    const items = await apiAll(`${base}/checkpoints?limit=100`, 1000);
    const body = document.querySelector("#checkpoints-table tbody");
    body.replaceChildren(...items.sort((a, b) => b.step_number - a.step_number).map((c) => {
      const m = c.metrics || {};
      return el("tr",
        el("td", el("div.cell-main.mono", c.fine_tuned_model_checkpoint || c.id), el("div.cell-sub.mono", c.id)),
        el("td.num", c.step_number ?? m.step ?? "—"),
        el("td.num", fmt.loss(m.train_loss)),
        el("td.num", fmt.loss(m.valid_loss ?? m.full_valid_loss)),
        el("td.num", m.train_mean_token_accuracy !== undefined && m.train_mean_token_accuracy !== null ? `${(100 * m.train_mean_token_accuracy).toFixed(1)}%` : "—"),
        el("td.num", fmt.age(c.created_at)));
    }));
    document.getElementById("checkpoints-empty").replaceChildren(items.length ? "" :
      emptyState("⛁", "No checkpoints yet", "The trainer registers one every few steps and when it stops."));
  }

  async function loadArtifacts() {
    let items = [];
    try {
      const page = await api(`${base}/artifacts`);
      items = page.data || page.files || [];
    } catch (err) {
      if (!(err instanceof tf.ApiError && err.status === 404)) throw err;
    }
    const body = document.querySelector("#artifacts-table tbody");
    body.replaceChildren(...items.map((a) => {
      const href = a.download_url || a.url || `${base}/artifacts/${a.name.split("/").map(encodeURIComponent).join("/")}`;
      return el("tr", { "data-name": a.name },
        el("td.mono", a.name),
        el("td.num", fmt.bytes(a.bytes)),
        el("td", el("code.small", { title: a.sha256, "data-sha256": a.sha256 }, a.sha256 ? `${a.sha256.slice(0, 16)}…` : "—")),
        el("td.right", el("a.btn.small", { href, download: a.name.split("/").pop() }, "Download")));
    }));
    document.getElementById("artifacts-empty").replaceChildren(items.length ? "" :
      emptyState("⇩", "No artifacts yet", job && LIVE.has(job.status)
        ? "The adapter, training config, metrics log and checksum manifest appear here when training ends."
        : "This job produced no output files."));
  }

  // ---- log tail -----------------------------------------------------------------------

  let logText = "";
  async function loadLog() {
    let text;
    try {
      const response = await api(`${base}/logs?tail=400`, { raw: true });
      if (response.status === 404) return;
      if (!response.ok) return;
      const type = response.headers.get("content-type") || "";
      if (type.includes("json")) {
        const data = await response.json();
        text = data.text ?? (data.lines || data.data || []).map((l) => (typeof l === "string" ? l : l.message || l.line || "")).join("\n");
      } else {
        text = await response.text();
      }
    } catch (err) {
      if (err instanceof tf.Unreachable) throw err;
      return;
    }
    if (text === logText || !text) return;
    logText = text;
    const box = document.getElementById("log");
    box.textContent = text;
    if (document.getElementById("log-follow").checked) box.scrollTop = box.scrollHeight;
  }

  // ---- live stream --------------------------------------------------------------------

  function setLive(on, text) {
    document.getElementById("live-dot").classList.toggle("off", !on);
    document.getElementById("live-text").textContent = text;
  }

  let source = null;
  function openStream() {
    if (!window.EventSource || source) return;
    source = new EventSource(`${base}/stream`, { withCredentials: true });
    source.onopen = () => setLive(true, "live");
    source.onerror = () => {
      if (job && !LIVE.has(job.status)) { closeStream(); return; }
      setLive(false, "reconnecting…");
    };
    const parse = (e) => { try { return JSON.parse(e.data); } catch (_) { return null; } };
    source.addEventListener("metric", (e) => { const m = parse(e); if (m) addMetric(m); });
    source.addEventListener("event", (e) => {
      const ev = parse(e);
      if (!ev) return;
      addEvent(ev);
      // A registered checkpoint or uploaded outputs: show them now, not at the next poll.
      if (ev.data?.checkpoint) loadCheckpoints().catch(() => {});
      if (ev.data?.files) loadArtifacts().catch(() => {});
    });
    source.addEventListener("status", (e) => { const s = parse(e); if (s) { addEvent(s); refresh(); } });
    source.addEventListener("job", (e) => { const j = parse(e); if (j && j.id === jobId) { job = j; renderHeader(); } });
    source.addEventListener("end", () => { closeStream(); refresh(); });
    source.addEventListener("done", () => { closeStream(); refresh(); });
    source.onmessage = (e) => {
      const d = parse(e);
      if (!d) return;
      if (d.object === "fine_tuning.job.event") addEvent(d);
      else if (d.type === "metric" || d.step !== undefined) addMetric(d);
    };
  }

  function closeStream() {
    if (source) { source.close(); source = null; }
    setLive(false, job ? `${tf.STATUS_LABELS[job.status] || job.status}` : "offline");
  }

  // ---- actions ------------------------------------------------------------------------

  async function act(action, title, text, label) {
    if (!(await confirmAction(title, text, label, action === "cancel"))) return;
    try {
      job = await api(`${base}/${action}`, { method: "POST" });
      renderHeader();
      loadEvents();
    } catch (err) {
      if (err instanceof tf.ApiError) {
        const box = notice("error", `Could not ${action} the job`, `${err.message}${err.code ? ` (${err.code})` : ""}`);
        document.getElementById("job-notices").prepend(box);
      }
    }
  }

  document.getElementById("btn-cancel").addEventListener("click", () =>
    act("cancel", "Cancel this job?", "The trainer stops after saving a checkpoint. A cancelled job cannot be resumed.", "Cancel job"));
  document.getElementById("btn-pause").addEventListener("click", () =>
    act("pause", "Pause this job?", "The trainer checkpoints and releases its GPUs; resume continues from the checkpoint.", "Pause"));
  document.getElementById("btn-resume").addEventListener("click", () =>
    act("resume", "Resume this job?", "The job goes back into the queue and continues from its last checkpoint.", "Resume"));

  // ---- start --------------------------------------------------------------------------

  async function refresh() {
    await loadJob();
    await Promise.all([loadCheckpoints(), loadArtifacts(), loadLog()]);
    if (!LIVE.has(job.status)) closeStream();
  }

  (async () => {
    try {
      await loadJob();
    } catch (err) {
      if (err instanceof tf.ApiError && err.status === 404) {
        document.querySelector("main").replaceChildren(el("div.card.center-state", { "data-testid": "not-found" },
          el("div.code", "404"), el("div.title", "Job not found"), el("p", err.message)));
        return;
      }
      throw err;
    }
    await Promise.allSettled([loadMetrics(), loadEvents(), loadCheckpoints(), loadArtifacts(), loadLog()]);
    if (LIVE.has(job.status)) openStream(); else setLive(false, tf.STATUS_LABELS[job.status] || job.status);
    every(2000, async () => {
      if (!job || !LIVE.has(job.status)) return;
      await refresh();
    });
  })();
})();
