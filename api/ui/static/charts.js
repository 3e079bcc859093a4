/* Line charts over uPlot (vendored, MIT): a series chart that grows as points arrive.
 *
 * tf.lineChart(container, {series: [{label, color, fmt}], xLabel, yFmt, yTick, empty})
 * returns {add(x, ys), setData(rows), count()}. x is a step (or a unix time when
 * xTime is set); a null y leaves a gap. yTick(v, ticks) labels the y axis and gets all of
 * its ticks, so it can pick the precision that tells them apart. Only series that have
 * data are drawn and listed in the legend (a job without a validation file has no
 * "valid" line); a series' first point adds it. The chart resizes with its container.
 */
(function () {
  "use strict";

  function lineChart(container, opts) {
    const xs = [];
    const ys = opts.series.map(() => []);
    let plot = null;
    const empty = tf.el("div.chart-empty", opts.empty || "Waiting for the first data point…");
    container.append(empty);

    // Which series have a point yet (k -> true): the chart shows those only.
    const seen = opts.series.map(() => false);
    let shown = "";
    const shownKey = () => seen.map((on) => (on ? "1" : "0")).join("");
    const shownData = () => [xs, ...ys.filter((_, k) => seen[k])];

    function build() {
      const width = Math.max(200, container.clientWidth);
      const series = [{ label: opts.xLabel || "step", value: (u, v) => (v === null ? "—" : opts.xTime ? tf.fmt.clock(v) : String(v)) }];
      for (const s of opts.series.filter((_, k) => seen[k])) {
        series.push({
          label: s.label,
          stroke: s.color,
          width: 2,
          fill: s.fill || null,
          spanGaps: true,
          points: { show: false },
          value: (u, v) => (v === null || v === undefined ? "—" : (s.fmt || opts.yFmt || String)(v)),
        });
      }
      plot = new uPlot({
        width,
        height: 200,
        series,
        scales: { x: { time: Boolean(opts.xTime) } },
        axes: [
          { stroke: "#667085", grid: { stroke: "#f2f4f7" }, ticks: { stroke: "#eaecf0" } },
          {
            stroke: "#667085", grid: { stroke: "#f2f4f7" }, ticks: { stroke: "#eaecf0" },
            // Wide enough for the longest label (about 7 px a character), e.g. "504.52 MiB".
            size: (u, values) => Math.max(72, 20 + 7 * Math.max(0, ...(values || []).map((v) => String(v).length))),
            values: (u, vals) => vals.map((v) => (opts.yTick || opts.yFmt || String)(v, vals)),
          },
        ],
        legend: { live: true },
        cursor: { drag: { x: true, y: false } },
      }, shownData(), container);
      shown = shownKey();
      container.dataset.points = String(xs.length);
      container.dataset.series = opts.series.filter((_, k) => seen[k]).map((s) => s.label).join(",");
    }

    // Points may arrive by the thousand (an SSE replay of a long run): redraw at most
    // once per animation frame, never once per point.
    let pending = false;
    function redraw() {
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => {
        pending = false;
        if (!xs.length || !seen.some(Boolean)) return;
        if (!plot) { empty.remove(); build(); return; }
        // uPlot cannot add a series to a drawn chart's legend: a new one rebuilds it.
        if (shownKey() !== shown) { plot.destroy(); plot = null; build(); return; }
        plot.setData(shownData());
        container.dataset.points = String(xs.length);
      });
    }

    /** Insert or replace the point at x (keeps x sorted; a re-sent step replaces). */
    function put(x, values) {
      values.forEach((v, k) => { if (v !== null && v !== undefined) seen[k] = true; });
      let i = xs.length;
      while (i > 0 && xs[i - 1] > x) i -= 1;
      if (i > 0 && xs[i - 1] === x) {
        values.forEach((v, k) => { ys[k][i - 1] = v ?? null; });
        return;
      }
      xs.splice(i, 0, x);
      values.forEach((v, k) => ys[k].splice(i, 0, v ?? null));
    }

    new ResizeObserver(() => {
      if (plot) plot.setSize({ width: Math.max(200, container.clientWidth), height: 200 });
    }).observe(container);

    return {
      add(x, values) { put(x, values); redraw(); },
      setData(rows) { for (const [x, values] of rows) put(x, values); redraw(); },
      count() { return xs.length; },
    };
  }

  window.tf.lineChart = lineChart;
})();
