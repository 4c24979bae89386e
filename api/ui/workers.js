// The Workers view: each live worker's engine as of its last heartbeat, and each model's queue.

import { get } from "./api.js";
import { $, bar, el, show } from "./dom.js";
import * as fmt from "./format.js";

const STALE = 10; // seconds without a heartbeat before it is shown as late

function workerRow(worker) {
  const heartbeat = fmt.now() - worker.last_seen;
  const kv = worker.kv_cache_usage;
  return el(
    "tr",
    { "data-worker-id": worker.id },
    el("td", { class: "mono", text: worker.id }),
    el("td", { class: "model", text: worker.models.join(", ") }),
    el("td", {
      class: "mono fingerprint",
      title: worker.fingerprint ?? "",
      text: worker.fingerprint ? worker.fingerprint.slice(0, 15) : fmt.DASH,
    }),
    el("td", { class: "device", text: worker.device ?? fmt.DASH }),
    el("td", { class: "num", text: fmt.count(worker.running_requests) }),
    el("td", { class: "num", text: fmt.count(worker.waiting_requests) }),
    el("td", { class: "num", text: fmt.count(worker.in_flight_requests) }),
    el("td", { class: "num", text: fmt.count(worker.running_shards) }),
    el(
      "td",
      { class: "wide" },
      kv === null
        ? fmt.DASH
        : el("div", { class: "progress" }, bar(kv, `KV cache of ${worker.id}`, kv > 0.9 ? "bad" : ""),
          el("span", { class: "num", text: fmt.percent(kv) })),
    ),
    el("td", { class: "num", text: fmt.percent(worker.prefix_cache_hit_rate) }),
    el("td", {
      class: `num heartbeat ${heartbeat > STALE ? "bad-text" : ""}`,
      title: fmt.time(worker.last_seen),
      text: `${fmt.duration(heartbeat)} ago`,
    }),
    el("td", { class: "num", text: fmt.age(worker.started_at) }),
  );
}

function queueRow(queue) {
  return el(
    "tr",
    { "data-model": queue.model },
    el("td", { class: "model", text: queue.model || fmt.DASH }),
    el("td", { class: `num ${queue.workers ? "" : "bad-text"}`, text: fmt.count(queue.workers) }),
    el("td", { class: "num queued", text: fmt.count(queue.queued_requests) }),
    el("td", { class: "num", text: fmt.count(queue.queued_shards) }),
    el("td", { class: "num", text: fmt.count(queue.running_shards) }),
    el("td", { class: "num", text: fmt.count(queue.batches_in_progress) }),
  );
}

// fetches the view's data; returns what puts it on the page
export async function refreshWorkers() {
  const [workers, queues] = await Promise.all([get("v1/workers"), get("v1/queues")]);
  return () => {
    $("workers-body").replaceChildren(...workers.data.map(workerRow));
    show($("workers-empty"), workers.data.length === 0);
    $("queues-body").replaceChildren(...queues.data.map(queueRow));
    show($("queues-empty"), queues.data.length === 0);
  };
}

export function clearWorkers() {
  $("workers-body").replaceChildren();
  $("queues-body").replaceChildren();
  show($("workers-empty"), false);
  show($("queues-empty"), false);
}
