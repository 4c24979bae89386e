// The page's only way to the API: the /v1 routes beside it, with the tab's API key if it has one.

const KEY = "conveyor.apiKey";
// the page is served at <api>/ui/: the API's routes are one level up, wherever it is mounted
const BASE = new URL("../", document.baseURI);

export class AuthError extends Error {}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY);
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

function headers() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function send(path, init = {}) {
  const response = await fetch(new URL(path, BASE), {
    ...init,
    headers: { ...headers(), ...(init.headers || {}) },
    cache: "no-store",
  });
  if (response.status === 401) throw new AuthError("the API wants a valid key");
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      message = (await response.json()).error.message || message;
    } catch {
      // not the API's error shape: keep the status line
    }
    throw new ApiError(response.status, message);
  }
  return response;
}

export async function get(path, params = {}) {
  const query = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    for (const item of [].concat(value)) {
      if (item !== undefined && item !== null && item !== "") query.append(name, item);
    }
  }
  const text = query.toString();
  return (await send(text ? `${path}?${text}` : path)).json();
}

export async function post(path) {
  return (await send(path, { method: "POST" })).json();
}

export function id(value) {
  return encodeURIComponent(value);
}

export function fileUrl(fileId) {
  return new URL(`v1/files/${id(fileId)}/content`, BASE).href;
}

// A file's content saved under `name`: fetched with the key (a plain link cannot send it).
export async function download(fileId, name) {
  const blob = await (await send(`v1/files/${id(fileId)}/content`)).blob();
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = name;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 60_000);
}
