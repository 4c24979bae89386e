// Numbers, durations and times as the page shows them. A missing value is a dash.

export const DASH = "—";

export function count(n) {
  return n === null || n === undefined ? DASH : Number(n).toLocaleString("en-US");
}

export function percent(fraction, digits = 0) {
  if (fraction === null || fraction === undefined || !Number.isFinite(fraction)) return DASH;
  return `${(fraction * 100).toFixed(digits)}%`;
}

export function rate(perSecond) {
  if (perSecond === null || perSecond === undefined || !Number.isFinite(perSecond)) return DASH;
  if (perSecond >= 1000) return `${(perSecond / 1000).toFixed(1)}k`;
  if (perSecond >= 100) return perSecond.toFixed(0);
  if (perSecond >= 10) return perSecond.toFixed(1);
  return perSecond.toFixed(2);
}

// 42s, 3m 12s, 2h 5m, 3d 4h
export function duration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return DASH;
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function now() {
  return Date.now() / 1000;
}

export function age(unixSeconds) {
  return unixSeconds ? duration(now() - unixSeconds) : DASH;
}

const pad = (n) => String(n).padStart(2, "0");

// local time, 2025-01-31 23:59:07
export function time(unixSeconds) {
  if (!unixSeconds) return DASH;
  const d = new Date(unixSeconds * 1000);
  const day = `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}`;
  return `${day} ${clock(unixSeconds)}`;
}

export function clock(unixSeconds) {
  const d = new Date(unixSeconds * 1000);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

export function statusLabel(status) {
  return String(status).replace("_", " ");
}
