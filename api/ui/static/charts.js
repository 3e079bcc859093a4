/* Line charts over uPlot (vendored, MIT): a series chart that grows as points arrive.
 *
 * tf.lineChart(container, {series: [{label, color, fmt}], xLabel, yFmt, empty})
 * returns {add(x, ys), setData(rows), count()}. x is a step (or a unix time when
 * xTime is set); a null y leaves a gap. The chart resizes with its container.
 */
(function () {
  "use strict";

  function lineChart(container, opts) {
    const xs = [];
    const ys = opts.series.map(() => []);
    let plot = null;
    const empty = tf.el("div.chart-empty", opts.empty || "Waiting for the first data point…");
    container.append(empty);

    function build() {
      const width = Math.max(200, container.clientWidth);
      const series = [{ label: opts.xLabel || "step", value: (u, v) => (v === null ? "—" : opts.xTime ? tf.fmt.clock(v) : String(v)) }];
      for (const s of opts.series) {
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
            stroke: "#667085", grid: { stroke: "#f2f4f7" }, ticks: { stroke: "#eaecf0" }, size: 72,
            values: (u, vals) => vals.map((v) => (opts.yTick || opts.yFmt || String)(v)),
          },
        ],
        legend: { live: true },
        cursor: { drag: { x: true, y: false } },
      }, [xs, ...ys], container);
      container.dataset.points = String(xs.length);
    }

    // Points may arrive by the thousand (an SSE replay of a long run): redraw at most
    // once per animation frame, never once per point.
    let pending = false;
    function redraw() {
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => {
        pending = false;
        if (!xs.length) return;
        if (!plot) { empty.remove(); build(); return; }
        plot.setData([xs, ...ys]);
        container.dataset.points = String(xs.length);
      });
    }

    /** Insert or replace the point at x (keeps x sorted; a re-sent step replaces). */
    function put(x, values) {
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
