// A batch's throughput over time: one bar per interval of its results (from the ledger's
// result timestamps), output tokens per second, or results per second when it has no tokens.

import { el, svg } from "./dom.js";
import * as fmt from "./format.js";

const WIDTH = 600;
const HEIGHT = 140;
const MIN_SLOTS = 20; // a few bars stay bars, not blocks

export function throughputChart(series, running) {
  const points = series.data;
  if (!points.length) return el("p", { class: "empty", text: "No results yet." });
  const step = series.bucket_seconds;
  const tokens = points.some((p) => p.output_tokens > 0);
  const unit = tokens ? "tok/s" : "results/s";
  const values = points.map((p) => (tokens ? p.output_tokens : p.requests) / step);
  const peak = Math.max(...values);
  const slot = WIDTH / Math.max(points.length, MIN_SLOTS);
  const bars = points.map((p, i) => {
    const height = peak > 0 ? (values[i] / peak) * (HEIGHT - 4) : 0;
    const partial = running && i === points.length - 1;
    return svg(
      "rect",
      {
        x: (i * slot + slot * 0.1).toFixed(2),
        y: (HEIGHT - height).toFixed(2),
        width: (slot * 0.8).toFixed(2),
        height: height.toFixed(2),
        class: `${p.failed ? "has-failed" : ""} ${partial ? "partial" : ""}`,
      },
      svg("title", {
        text: `${fmt.clock(p.start)}: ${fmt.count(p.requests)} results (${fmt.count(p.failed)} failed), ` +
          `${fmt.count(p.output_tokens)} output tokens, ${fmt.rate(values[i])} ${unit}`,
      }),
    );
  });
  const last = points[points.length - 1].start + step;
  return el(
    "figure",
    { class: "chart" },
    el("div", { class: "chart-peak muted", text: `peak ${fmt.rate(peak)} ${unit}` }),
    svg(
      "svg",
      {
        viewBox: `0 0 ${WIDTH} ${HEIGHT}`,
        preserveAspectRatio: "none",
        role: "img",
        "aria-label": `throughput, ${unit}, per ${step} s`,
      },
      ...bars,
    ),
    el(
      "figcaption",
      { class: "chart-axis muted" },
      el("span", { text: fmt.clock(points[0].start) }),
      el("span", { text: `${unit}, one bar per ${fmt.duration(step)}` }),
      el("span", { text: fmt.clock(last) }),
    ),
  );
}
