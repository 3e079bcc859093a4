/* Queue & pools page: pool capacity from GET /v1/node_pools (when the server has it),
 * running jobs grouped by pool and the queue from GET /v1/fine_tuning/jobs, and a
 * GPUs-in-use chart rebuilt from the jobs' start/finish times (no sampled history is
 * invented: the curve is exactly what those timestamps imply). A CPU pool's units are
 * named slots, not GPUs (tf.devices).
 */
(function () {
  "use strict";
  const { api, apiAll, el, fmt, pill, emptyState, every, devices } = tf;
  const MAX_WINDOW_S = 24 * 3600;
  const MIN_WINDOW_S = 5 * 60;
  // Every job listed here is one the viewer may open (its own; an admin: all).
  const jobLink = (j) => el("a.mono.small", { href: `/ui/jobs/${encodeURIComponent(j.id)}` }, j.id);
  let util = null;

  function poolCard(p) {
    const unit = devices(p.accelerator);
    const pct = p.gpus_total ? Math.min(100, (100 * p.gpus_used) / p.gpus_total) : 0;
    const source = p.capacity_source === "cluster"
      ? `nodes observed in the cluster ${fmt.age(p.observed_at)}`
      : "nodes from the pools file";
    const card = el("div.card", { "data-pool": p.name, "data-capacity-source": p.capacity_source,
      "data-accelerator": p.accelerator },
      el("div.card-head", el("h2", p.name), el("span.tag", p.accelerator || "—"),
        el("span.right", p.gpu_memory_bytes ? `${fmt.bytes(p.gpu_memory_bytes)} per ${unit.one}` : "")),
      el("div.meter-row", { style: "grid-template-columns: 90px 1fr 120px" },
        el("div.name", unit.title),
        el("div.meter", el("div.fill", { style: `width:${pct}%` })),
        el("div.fig", `${p.gpus_used} used · ${p.gpus_free} free / ${p.gpus_total}`)),
      el("div.small.muted", [
        p.trainers.length ? `trainer ${p.trainers.join(", ")}` : null,
        `${fmt.money(p.price_per_gpu_hour)}/${unit.one}-hour`,
        `${p.gpus_per_node} ${unit.many}/node`,
        p.queued_jobs ? `${p.queued_jobs} queued` : null,
        source,
      ].filter(Boolean).join(" · ")));
    if (p.node_list.length) {
      card.append(el("div", { style: "margin-top:12px" }, el("h3", "Nodes"),
        ...p.node_list.map((n) => el("div.meter-row", { style: "grid-template-columns: 140px 1fr 80px; padding:4px 0", "data-node": n.name },
          el("div.mono.small", n.name),
          el("div.gpu-dots", Array.from({ length: n.gpus_total }, (_, i) => el(`span.gpu-dot${i < n.gpus_used ? ".used" : ""}`))),
          el("div.fig", `${n.gpus_used}/${n.gpus_total}`)))));
    }
    return card;
  }

  function runningList(jobs, accelerators) {
    const box = document.getElementById("running");
    if (!jobs.length) {
      box.replaceChildren(emptyState("◌", "Nothing is running", "Queued jobs start as soon as a pool has room."));
      return;
    }
    const byPool = new Map();
    for (const j of jobs) {
      const k = j.pool || "unplaced";
      if (!byPool.has(k)) byPool.set(k, []);
      byPool.get(k).push(j);
    }
    box.replaceChildren(...[...byPool.entries()].map(([pool, list]) => el("div", { style: "padding:6px 20px 12px" },
      el("h3", { style: "margin-top:8px" }, pool),
      ...list.map((j) => el("div", { style: "display:flex;gap:10px;align-items:center;padding:6px 0" },
        pill(j.status), jobLink(j),
        el("span.muted.small", { style: "margin-left:auto" },
          `${j.gpus ?? "?"} ${devices(accelerators.get(j.pool)).one} · `
          + `${j.total_steps ? `${j.current_step || 0}/${j.total_steps}` : "starting"}`))))));
  }

  function queueTable(jobs) {
    // In the scheduler's order: its last cycle numbered every waiting job (priority, fair
    // share, age); jobs it has not seen yet (just created, or still validating) follow.
    const queued = jobs.filter((j) => j.status === "queued" || j.status === "validating_files")
      .sort((a, b) => (a.queue_position ?? Infinity) - (b.queue_position ?? Infinity)
        || (b.priority || 0) - (a.priority || 0) || a.created_at - b.created_at);
    const body = document.querySelector("#queue-table tbody");
    body.replaceChildren(...queued.map((j) => el("tr", { "data-job-id": j.id },
      el("td.num", j.queue_position ? String(j.queue_position) : el("span.muted", "—")),
      el("td", jobLink(j), el("div", pill(j.status))),
      el("td", j.model),
      el("td.num", j.priority ?? "—"),
      el("td.small", j.queue_reason || el("span.muted", j.status === "validating_files" ? "validating files" : "waiting for the next scheduling cycle")),
      el("td.num.nowrap", fmt.age(j.created_at)))));
    document.getElementById("queue-empty").replaceChildren(queued.length ? "" :
      emptyState("✓", "The queue is empty", "Every submitted job is running or finished."));
  }

  function utilization(jobs, unit) {
    const now = Date.now() / 1000;
    // From shortly before the earliest start we know of, between 15 minutes and a day.
    const starts = jobs.filter((j) => j.started_at).map((j) => j.started_at);
    const earliest = starts.length ? Math.min(...starts) - 60 : now - MIN_WINDOW_S;
    const from = Math.max(now - MAX_WINDOW_S, Math.min(earliest, now - MIN_WINDOW_S));
    document.getElementById("util-window").textContent = fmt.duration(now - from);
    document.getElementById("util-unit").textContent = unit.title;
    const changes = [];
    for (const j of jobs) {
      if (!j.started_at || !j.gpus) continue;
      const end = j.finished_at || (j.status === "running" ? now : null);
      if (end === null || end < from) continue;
      changes.push([Math.max(from, j.started_at), j.gpus], [end, -j.gpus]);
    }
    changes.sort((a, b) => a[0] - b[0]);
    const rows = [];
    let level = 0;
    rows.push([from, [0]]);
    for (const [t, d] of changes) {
      rows.push([t - 0.001, [level]]);
      level += d;
      rows.push([t, [level]]);
    }
    rows.push([now, [level]]);
    if (!util) {
      util = tf.lineChart(document.getElementById("chart-util"), {
        series: [{ label: `${unit.title} in use`, color: "#4f46e5", fill: "rgba(79,70,229,0.12)" }],
        xTime: true, xLabel: "time", yFmt: (v) => String(Math.round(v * 10) / 10),
      });
    }
    util.setData(rows);
  }

  async function refresh() {
    const jobs = await apiAll("/ui/api/jobs?limit=100", 500);
    const running = jobs.filter((j) => j.status === "running");
    let pools = null;
    try {
      pools = (await api("/v1/node_pools")).data || [];
    } catch (err) {
      if (!(err instanceof tf.ApiError)) throw err;
    }
    const box = document.getElementById("pools");
    if (pools === null) {
      box.replaceChildren(el("div.card", { "data-testid": "pools-unavailable", style: "grid-column: 1 / -1" },
        emptyState("▦", "Pool capacity is not available", "This server does not expose GET /v1/node_pools yet. Running jobs and the queue below come from the jobs API.")));
    } else if (!pools.length) {
      box.replaceChildren(el("div.card", { style: "grid-column: 1 / -1" }, emptyState("▦", "No node pools configured", "Declare pools in TUNEFLEET_NODE_POOLS_FILE.")));
    } else {
      box.replaceChildren(...pools.map(poolCard));
    }
    const accelerators = new Map((pools || []).map((p) => [p.name, p.accelerator]));
    runningList(running, accelerators);
    queueTable(jobs);
    utilization(jobs, devices([...accelerators.values()]));
  }

  every(5000, refresh);
})();
