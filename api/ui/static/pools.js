/* Queue & pools page: pool capacity from GET /v1/node_pools (when the server has it),
 * running jobs grouped by pool and the queue from GET /v1/fine_tuning/jobs, and a
 * GPUs-in-use chart rebuilt from the jobs' start/finish times (no sampled history is
 * invented: the curve is exactly what those timestamps imply).
 */
(function () {
  "use strict";
  const { api, apiAll, el, fmt, pill, emptyState, every } = tf;
  const MAX_WINDOW_S = 24 * 3600;
  const MIN_WINDOW_S = 5 * 60;
  const ownJob = (j) => j.organization_id === tf.page().principal.tenant_id;
  const jobLink = (j) => (ownJob(j)
    ? el("a.mono.small", { href: `/ui/jobs/${encodeURIComponent(j.id)}` }, j.id)
    : el("span.mono.small", { title: "another organization's job" }, j.id));
  let util = null;

  function poolCard(p, running) {
    const total = p.gpus_total ?? p.capacity?.gpus ?? (p.gpus_per_node && p.nodes !== undefined ? p.gpus_per_node * (Array.isArray(p.nodes) ? p.nodes.length : p.nodes) : null);
    const used = p.gpus_used ?? p.usage?.gpus ?? running.reduce((n, j) => n + (j.gpus || 0), 0);
    const free = p.gpus_free ?? (total !== null ? Math.max(0, total - used) : null);
    const pct = total ? Math.min(100, (100 * used) / total) : 0;
    const nodes = Array.isArray(p.nodes) ? p.nodes : null;
    const card = el("div.card", { "data-pool": p.name },
      el("div.card-head", el("h2", p.name), el("span.tag", p.accelerator || "—"),
        el("span.right", p.gpu_memory_bytes ? `${fmt.bytes(p.gpu_memory_bytes)} per GPU` : "")),
      el("div.meter-row", { style: "grid-template-columns: 90px 1fr 120px" },
        el("div.name", "GPUs"),
        el("div.meter", el("div.fill", { style: `width:${pct}%` })),
        el("div.fig", total !== null ? `${used} used · ${free} free / ${total}` : `${used} used`)),
      el("div.small.muted", [
        (p.trainers || (p.trainer ? [p.trainer] : [])).length ? `trainer ${(p.trainers || [p.trainer]).join(", ")}` : null,
        p.price_per_gpu_hour !== undefined ? `${fmt.money(p.price_per_gpu_hour)}/GPU-hour` : null,
        p.gpus_per_node ? `${p.gpus_per_node} GPUs/node` : null,
      ].filter(Boolean).join(" · ")));
    if (nodes && nodes.length) {
      card.append(el("div", { style: "margin-top:12px" }, el("h3", "Nodes"),
        ...nodes.map((n) => {
          const cap = n.gpus ?? n.gpus_total ?? n.allocatable ?? p.gpus_per_node ?? 0;
          const busy = n.gpus_used ?? n.used ?? 0;
          return el("div.meter-row", { style: "grid-template-columns: 140px 1fr 80px; padding:4px 0" },
            el("div.mono.small", n.name || "node"),
            el("div.gpu-dots", Array.from({ length: cap }, (_, i) => el(`span.gpu-dot${i < busy ? ".used" : ""}`))),
            el("div.fig", `${busy}/${cap}`));
        })));
    }
    return card;
  }

  function runningList(jobs) {
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
        el("span.muted.small", { style: "margin-left:auto" }, `${j.gpus ?? "?"} GPU · ${j.total_steps ? `${j.current_step || 0}/${j.total_steps}` : "starting"}`))))));
  }

  function queueTable(jobs) {
    // Order as the scheduler does first: priority, then age (fair share is the
    // scheduler's business; it reports the resulting reason on each job).
    const queued = jobs.filter((j) => j.status === "queued" || j.status === "validating_files")
      .sort((a, b) => (b.priority || 0) - (a.priority || 0) || a.created_at - b.created_at);
    const body = document.querySelector("#queue-table tbody");
    body.replaceChildren(...queued.map((j, i) => el("tr", { "data-job-id": j.id },
      el("td.num", String(i + 1)),
      el("td", jobLink(j), el("div", pill(j.status))),
      el("td", j.model),
      el("td.num", j.priority ?? "—"),
      el("td.small", j.queue_reason || el("span.muted", j.status === "validating_files" ? "validating files" : "waiting for the next scheduling cycle")),
      el("td.num.nowrap", fmt.age(j.created_at)))));
    document.getElementById("queue-empty").replaceChildren(queued.length ? "" :
      emptyState("✓", "The queue is empty", "Every submitted job is running or finished."));
  }

  function utilization(jobs) {
    const now = Date.now() / 1000;
    // From shortly before the earliest start we know of, between 15 minutes and a day.
    const starts = jobs.filter((j) => j.started_at).map((j) => j.started_at);
    const earliest = starts.length ? Math.min(...starts) - 60 : now - MIN_WINDOW_S;
    const from = Math.max(now - MAX_WINDOW_S, Math.min(earliest, now - MIN_WINDOW_S));
    document.getElementById("util-window").textContent = fmt.duration(now - from);
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
        series: [{ label: "GPUs in use", color: "#4f46e5", fill: "rgba(79,70,229,0.12)" }],
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
      box.replaceChildren(...pools.map((p) => poolCard(p, running.filter((j) => j.pool === p.name))));
    }
    runningList(running);
    queueTable(jobs);
    utilization(jobs);
  }

  every(5000, refresh);
})();
