/* tunefleet dashboard: shared helpers for the page scripts (no framework).
 *
 * Every page is rendered by the server with the signed-in principal; page scripts call
 * the same JSON API the SDK uses (/v1/...), authenticated by the HttpOnly session cookie.
 * Unsafe calls carry the session's CSRF token (from <meta name="csrf-token">) in the
 * X-CSRF-Token header. A failed fetch (server down, proxy error) shows one banner that
 * clears itself on the next successful call.
 */
(function () {
  "use strict";

  const csrfToken = () => document.querySelector('meta[name="csrf-token"]')?.content || "";

  class ApiError extends Error {
    constructor(status, body) {
      const err = (body && body.error) || {};
      super(err.message || `HTTP ${status}`);
      this.status = status;
      this.code = err.code || null;
      this.param = err.param || null;
      this.type = err.type || null;
      this.body = body;
    }
  }

  class Unreachable extends Error {}

  function setBanner(text) {
    const banner = document.getElementById("api-banner");
    if (!banner) return;
    if (text) {
      banner.textContent = text;
      banner.classList.add("show");
    } else {
      banner.classList.remove("show");
    }
  }

  /** Call the JSON API. Resolves with parsed JSON (or Response when raw), throws ApiError
   *  for an error answer and Unreachable when no answer came back. */
  async function api(path, { method = "GET", json, form, raw = false, signal } = {}) {
    const headers = { Accept: "application/json" };
    let body;
    if (json !== undefined) {
      headers["Content-Type"] = "application/json";
      body = JSON.stringify(json);
    } else if (form !== undefined) {
      body = form; // multipart: the browser sets the boundary
    }
    if (method !== "GET" && method !== "HEAD") headers["X-CSRF-Token"] = csrfToken();
    let response;
    try {
      response = await fetch(path, { method, headers, body, credentials: "same-origin", signal });
    } catch (err) {
      if (err.name === "AbortError") throw err;
      setBanner("Cannot reach the tunefleet API. Retrying… (is the server running?)");
      throw new Unreachable(String(err));
    }
    if (response.status >= 502 && response.status <= 504) {
      setBanner(`The tunefleet API is unavailable (HTTP ${response.status}). Retrying…`);
      throw new Unreachable(`HTTP ${response.status}`);
    }
    setBanner(null);
    if (response.status === 401) {
      // Session expired or key revoked: back to the login page, then here again.
      window.location.href = "/ui/login?next=" + encodeURIComponent(location.pathname + location.search);
      throw new ApiError(401, null);
    }
    if (raw) return response;
    let data = null;
    const text = await response.text();
    if (text) {
      try { data = JSON.parse(text); } catch (_) { data = { error: { message: text.slice(0, 300) } }; }
    }
    if (!response.ok) throw new ApiError(response.status, data);
    return data;
  }

  /** Fetch every page of a cursor-paginated list (OpenAI envelope), up to maxItems. */
  async function apiAll(path, maxItems = 2000) {
    const items = [];
    let after = null;
    for (;;) {
      const sep = path.includes("?") ? "&" : "?";
      const url = after ? `${path}${sep}after=${encodeURIComponent(after)}` : path;
      const page = await api(url);
      items.push(...(page.data || []));
      if (!page.has_more || !page.data?.length || items.length >= maxItems) return items;
      after = page.data[page.data.length - 1].id;
    }
  }

  // ---- formatting ---------------------------------------------------------------------

  const fmt = {
    num(v, digits = 0) {
      if (v === null || v === undefined || Number.isNaN(v)) return "—";
      return Number(v).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
    },
    loss(v) { return v === null || v === undefined ? "—" : Number(v).toFixed(4); },
    sci(v) { return v === null || v === undefined ? "—" : Number(v).toExponential(2); },
    bytes(v, digits = null) {
      if (v === null || v === undefined) return "—";
      const units = ["B", "KiB", "MiB", "GiB", "TiB"];
      let i = 0; let n = Number(v);
      while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
      const d = digits ?? (i === 0 ? 0 : n >= 100 ? 0 : 1);
      return `${n.toFixed(i === 0 ? 0 : d)} ${units[i]}`;
    },
    /** An axis tick in bytes, given all the axis' ticks: each in the unit of the largest,
     *  with as many decimals as the step between ticks needs to tell them apart (a narrow
     *  range reads 1.40, 1.42, 1.44 GiB, not 1.4 GiB five times). */
    bytesTick(v, ticks) {
      if (v === null || v === undefined) return "—";
      const units = ["B", "KiB", "MiB", "GiB", "TiB"];
      const top = Math.max(...ticks.map((t) => Math.abs(Number(t))));
      let i = 0;
      while (top >= 1024 ** (i + 1) && i < units.length - 1) i += 1;
      const scale = 1024 ** i;
      const step = ticks.length > 1 ? Math.abs(ticks[1] - ticks[0]) / scale : 0;
      // The fewest decimals with 10^-d <= step: neighbours then round to different labels.
      const d = i === 0 || !(step > 0) ? 0 : Math.min(6, Math.max(0, Math.ceil(-Math.log10(step) - 1e-9)));
      return `${(Number(v) / scale).toFixed(d)} ${units[i]}`;
    },
    duration(seconds) {
      if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "—";
      seconds = Math.max(0, Math.round(seconds));
      if (seconds < 60) return `${seconds}s`;
      const m = Math.floor(seconds / 60); const s = seconds % 60;
      if (m < 60) return s ? `${m}m ${s}s` : `${m}m`;
      const h = Math.floor(m / 60); const mm = m % 60;
      if (h < 48) return mm ? `${h}h ${mm}m` : `${h}h`;
      return `${Math.floor(h / 24)}d ${h % 24}h`;
    },
    age(unix) {
      if (!unix) return "—";
      return fmt.duration(Date.now() / 1000 - unix) + " ago";
    },
    time(unix) {
      if (!unix) return "—";
      return new Date(unix * 1000).toLocaleString("en-GB", { dateStyle: "medium", timeStyle: "medium" });
    },
    clock(unix) {
      if (!unix) return "—";
      return new Date(unix * 1000).toLocaleTimeString("en-GB");
    },
    money(v) { return v === null || v === undefined ? "—" : `$${Number(v).toFixed(v < 1 ? 3 : 2)}`; },
  };

  /** What a pool's "GPUs" are, by its accelerators: a CPU pool (the embedded `local`
   *  pool) runs one trainer per slot, so its units are slots and its GPU time is CPU time;
   *  a list mixing CPU and GPU pools counts devices. Unknown accelerators count as GPUs. */
  function devices(...accelerators) {
    const known = accelerators.flat().filter(Boolean);
    const cpu = known.filter((a) => a === "cpu").length;
    if (known.length && cpu === known.length) {
      return { one: "slot", many: "slots", title: "Slots", time: "CPU time" };
    }
    if (cpu) return { one: "device", many: "devices", title: "Devices", time: "Device time" };
    return { one: "GPU", many: "GPUs", title: "GPUs", time: "GPU time" };
  }

  // ---- DOM ----------------------------------------------------------------------------

  /** el("td.num", {title}, child, ...): a tiny element builder; strings become text nodes. */
  function el(spec, attrs, ...children) {
    const [tag, ...classes] = spec.split(".");
    const node = document.createElement(tag || "div");
    if (classes.length) node.className = classes.join(" ");
    if (attrs && (typeof attrs !== "object" || attrs instanceof Node || Array.isArray(attrs))) {
      children.unshift(attrs);
      attrs = null;
    }
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "dataset") Object.assign(node.dataset, v);
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else if (k === "text") node.textContent = v;
      else node.setAttribute(k, v === true ? "" : v);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  const STATUS_LABELS = {
    validating_files: "validating", queued: "queued", running: "running", paused: "paused",
    succeeded: "succeeded", failed: "failed", cancelled: "cancelled",
  };

  function pill(status) {
    return el(`span.pill.${status}`, { "data-status": status }, STATUS_LABELS[status] || status);
  }

  function progressBar(step, total, big = false) {
    const pct = total ? Math.min(100, (100 * (step || 0)) / total) : 0;
    const bar = el(`div.progress${big ? ".big" : ""}${pct >= 100 ? ".done" : ""}`, el("span", { style: `width:${pct}%` }));
    return bar;
  }

  function emptyState(icon, title, text, action) {
    return el("div.empty", el("div.icon", icon), el("div.title", title), text ? el("div", text) : null,
      action ? el("div", { style: "margin-top:14px" }, action) : null);
  }

  function notice(kind, title, text) {
    return el(`div.notice.${kind}`, title ? el("div.title", title) : null, text ? el("div", text) : null);
  }

  /** Ask before a destructive action; resolves true when confirmed. */
  function confirmAction(title, text, confirmLabel = "Confirm", danger = true) {
    return new Promise((resolve) => {
      const dialog = el("dialog", { "data-testid": "confirm-dialog" },
        el("h2", title), el("p.muted", text),
        el("div.buttons",
          el("button.btn", { type: "button", value: "cancel", "data-action": "cancel" }, "Keep it"),
          el(`button.btn${danger ? ".danger" : ".primary"}`, { type: "button", "data-action": "confirm" }, confirmLabel)));
      document.body.append(dialog);
      const done = (ok) => { dialog.close(); dialog.remove(); resolve(ok); };
      dialog.querySelector('[data-action="cancel"]').addEventListener("click", () => done(false));
      dialog.querySelector('[data-action="confirm"]').addEventListener("click", () => done(true));
      dialog.addEventListener("cancel", () => done(false));
      dialog.showModal();
    });
  }

  /** Run fn now and every intervalMs while the tab is visible; returns a stop function.
   *  Errors are shown by api() (banner) and do not stop the loop. */
  function every(intervalMs, fn) {
    let timer = null; let stopped = false;
    const tick = async () => {
      if (stopped) return;
      if (document.visibilityState !== "hidden") {
        try { await fn(); } catch (err) { if (!(err instanceof Unreachable)) console.error(err); }
      }
      if (!stopped) timer = setTimeout(tick, intervalMs);
    };
    tick();
    return () => { stopped = true; clearTimeout(timer); };
  }

  const page = () => JSON.parse(document.getElementById("page-data")?.textContent || "{}");

  // Forms that scripts drive (filters, the new-job form) never submit themselves: the
  // page's Content-Security-Policy allows no inline handlers such as onsubmit="...".
  document.querySelectorAll("form[data-script-form]").forEach((form) => {
    form.addEventListener("submit", (event) => event.preventDefault());
  });

  window.tf = { api, apiAll, csrfToken, ApiError, Unreachable, fmt, el, pill, progressBar, emptyState, notice,
    confirmAction, every, page, setBanner, STATUS_LABELS, devices };
})();
