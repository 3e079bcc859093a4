/* Jobs list: one page of jobs from the dashboard endpoint GET /ui/api/jobs (the public
 * job objects + tenant name + latest metric; cursor pagination), filtered by status /
 * pool / tenant / search on the server, refreshed every few seconds.
 */
(function () {
  "use strict";
  const { api, el, fmt, pill, progressBar, emptyState, every } = tf;
  const PAGE_SIZE = 20;
  const isAdmin = tf.page().principal.is_admin;
  const form = document.getElementById("filters");
  const LIVE = new Set(["validating_files", "queued", "running", "paused"]);

  // Cursor stack: cursors[i] is the `after` of page i (null = newest page).
  let cursors = [null];
  let pageIndex = 0;
  let lastPage = null;

  function filters() {
    const data = new FormData(form);
    const params = new URLSearchParams();
    for (const name of ["status", "pool", "tenant", "q"]) {
      const v = (data.get(name) || "").trim();
      if (v) params.set(name, v);
    }
    return params;
  }

  function syncUrl() {
    const params = filters();
    history.replaceState(null, "", params.toString() ? `?${params}` : location.pathname);
  }

  function restoreFromUrl() {
    const params = new URLSearchParams(location.search);
    for (const name of ["status", "pool", "tenant", "q"]) {
      const input = form.elements[name];
      if (input && params.get(name)) {
        if (input.tagName === "SELECT" && ![...input.options].some((o) => o.value === params.get(name))) {
          input.append(el("option", { value: params.get(name) }, params.get(name)));
        }
        input.value = params.get(name);
      }
    }
  }

  function row(job, metric) {
    const total = job.total_steps || metric?.total_steps || job.hyperparameters?.total_steps || null;
    const step = Math.max(job.current_step || 0, metric?.step || 0);
    const eta = job.estimated_finish && LIVE.has(job.status) ? fmt.duration(job.estimated_finish - Date.now() / 1000) : "—";
    // Every listed job opens: a tenant lists its own, an admin every organization's (and
    // the job routes open for admins too, see api.jobs.may_open).
    const href = `/ui/jobs/${encodeURIComponent(job.id)}`;
    const tr = el("tr.link", { "data-job-id": job.id, "data-status": job.status },
      el("td", el("a.cell-main.mono", { href }, job.id),
        job.suffix ? el("div.cell-sub", job.suffix) : null),
      el("td", pill(job.status)),
      el("td", el("div", job.model), job.adapter?.method ? el("div.cell-sub", job.adapter.method.toUpperCase()) : null),
      isAdmin ? el("td.small", { title: job.organization_id }, job.tenant_name || job.organization_id || "—") : null,
      el("td", job.trainer && job.trainer !== "auto" ? el("span.tag", job.trainer) : el("span.muted", job.trainer || "—")),
      el("td", job.pool ? el("span.tag", job.pool) : el("span.muted", "—")),
      el("td.num", job.gpus ?? "—"),
      el("td", { style: "min-width:130px" }, progressBar(step, total), el("div.progress-label", total ? `${step} / ${total}` : step ? `${step}` : "—")),
      el("td.num", fmt.loss(metric?.train_loss)),
      el("td.num", metric?.tokens_per_s ? fmt.num(metric.tokens_per_s) : "—"),
      el("td.num", eta),
      el("td.num.nowrap", { title: fmt.time(job.created_at) }, fmt.age(job.created_at)));
    tr.addEventListener("click", (e) => { if (!e.target.closest("a")) location.href = href; });
    return tr;
  }

  async function load() {
    const params = filters();
    params.set("limit", String(PAGE_SIZE));
    if (cursors[pageIndex]) params.set("after", cursors[pageIndex]);
    const page = await api(`/ui/api/jobs?${params}`);
    lastPage = page;
    const jobs = page.data || [];
    const metrics = jobs.map((j) => j.latest_metric || null);
    // Pools seen on jobs join the pool filter (GET /v1/node_pools adds the rest, if served).
    for (const j of jobs) {
      const select = form.elements.pool;
      if (j.pool && ![...select.options].some((o) => o.value === j.pool)) select.append(el("option", { value: j.pool }, j.pool));
    }
    document.getElementById("jobs-body").replaceChildren(...jobs.map((j, i) => row(j, metrics[i])));
    const empty = document.getElementById("jobs-empty");
    const filtered = [...filters().keys()].length > 0;
    if (jobs.length) empty.replaceChildren();
    else if (filtered) empty.replaceChildren(emptyState("⌕", "No jobs match these filters", "Clear the search or pick another status."));
    else empty.replaceChildren(emptyState("✦", "No fine-tuning jobs yet", "Upload a training file and start your first job.",
      el("a.btn.primary", { href: "/ui/new" }, "+ New job")));
    document.getElementById("prev-page").disabled = pageIndex === 0;
    document.getElementById("next-page").disabled = !page.has_more;
    document.getElementById("page-info").textContent = jobs.length
      ? `Page ${pageIndex + 1} · ${jobs.length} job${jobs.length === 1 ? "" : "s"}` : "";
  }

  async function loadCounts() {
    // One small request per status: the API filters on the server.
    await Promise.all(["running", "queued", "succeeded", "failed"].map(async (status) => {
      const params = new URLSearchParams({ status, limit: "100" });
      const tenant = form.elements.tenant?.value;
      if (tenant) params.set("tenant", tenant);
      const page = await api(`/ui/api/jobs?${params}`);
      const n = (page.data || []).length;
      document.querySelector(`[data-count="${status}"]`).textContent = page.has_more ? `${n}+` : String(n);
    }));
  }

  async function loadFilterOptions() {
    try {
      const pools = await api("/v1/node_pools");
      const select = form.elements.pool;
      for (const p of pools.data || []) {
        if (![...select.options].some((o) => o.value === p.name)) select.append(el("option", { value: p.name }, p.name));
      }
    } catch (_) { /* pools endpoint not available: the filter keeps "All pools" only */ }
    if (isAdmin && form.elements.tenant) {
      try {
        const tenants = await api("/ui/api/tenants");
        for (const t of tenants.data || []) {
          if (![...form.elements.tenant.options].some((o) => o.value === t.id)) {
            form.elements.tenant.append(el("option", { value: t.id }, t.name || t.id));
          }
        }
      } catch (_) { /* no tenant listing: admins still see every job */ }
    }
  }

  function resetAndLoad() {
    cursors = [null]; pageIndex = 0; syncUrl(); load().catch(() => {}); loadCounts().catch(() => {});
  }

  let searchTimer = null;
  form.addEventListener("input", (e) => {
    if (e.target.name === "q") { clearTimeout(searchTimer); searchTimer = setTimeout(resetAndLoad, 250); }
  });
  form.addEventListener("change", (e) => { if (e.target.name !== "q") resetAndLoad(); });
  document.getElementById("next-page").addEventListener("click", () => {
    const data = lastPage?.data || [];
    if (!lastPage?.has_more || !data.length) return;
    cursors[pageIndex + 1] = data[data.length - 1].id;
    pageIndex += 1; load();
  });
  document.getElementById("prev-page").addEventListener("click", () => {
    if (pageIndex === 0) return;
    pageIndex -= 1; load();
  });

  restoreFromUrl();
  loadFilterOptions();
  let loadedOnce = false;
  every(3000, async () => {
    try {
      await Promise.all([load(), loadCounts()]);
      loadedOnce = true;
      document.getElementById("live-dot").classList.remove("off");
      document.getElementById("live-text").textContent = "live";
    } catch (err) {
      document.getElementById("live-dot").classList.add("off");
      document.getElementById("live-text").textContent = "offline";
      if (!loadedOnce && err instanceof tf.Unreachable) {
        document.getElementById("jobs-body").replaceChildren();
        document.getElementById("jobs-empty").replaceChildren(emptyState("⚠", "Jobs could not be loaded",
          "The tunefleet API did not answer. This page retries every few seconds."));
      }
      throw err;
    }
  });
})();
