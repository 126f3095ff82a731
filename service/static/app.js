// The kdeq page: pick a task and an image, call the API with Accept: application/json, show the input
// and the result side by side and under a before/after slider, with the solver's statistics.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { file: null, inputUrl: null, resultUrl: null, painted: false, models: [] };

function task() {
  return document.querySelector("input[name=task]:checked").value;
}

function apiKey() {
  return sessionStorage.getItem("kdeq-api-key") || "";
}

function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

function askForKey(reason) {
  $("key-box").hidden = false;
  $("api-key").focus();
  showError(reason);
}

async function describeError(response) {
  // the API's errors are JSON {"error", "detail"}; anything else is shown as its status
  try {
    const body = await response.json();
    if (body && body.detail) return `${response.status} ${body.error}: ${body.detail}`;
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText || "error"}`;
}

async function refreshStatus() {
  try {
    const ready = await fetch("/readyz");
    const body = await ready.json();
    $("status").textContent = ready.ok ? "ready" : `not ready: ${body.status}`;
    $("status").className = ready.ok ? "status ok" : "status bad";
  } catch (err) {
    $("status").textContent = "the service does not answer";
    $("status").className = "status bad";
  }
}

async function loadModels() {
  const response = await fetch("/models", { headers: authHeaders() });
  if (response.status === 401) {
    askForKey("This server needs an API key to list its models and to run them.");
    return;
  }
  if (!response.ok) {
    showError(await describeError(response));
    return;
  }
  state.models = await response.json();
  fillModels();
}

function fillModels() {
  const select = $("model");
  select.replaceChildren(new Option("default", ""));
  for (const m of state.models) {
    if (m.task !== task() || !m.ready) continue;
    select.add(new Option(`${m.id}${m.default ? " (default)" : ""} — ${m.description || ""}`, m.id));
  }
}

function showOptions() {
  for (const box of document.querySelectorAll(".options")) box.hidden = box.dataset.task !== task();
  $("mask-canvas").hidden = task() !== "inpaint" || !state.file;
  fillModels();
}

function setFile(file) {
  if (!file) return;
  state.file = file;
  state.painted = false;
  $("filename").textContent = `${file.name} (${Math.round(file.size / 1024)} kB)`;
  if (state.inputUrl) URL.revokeObjectURL(state.inputUrl);
  state.inputUrl = URL.createObjectURL(file);
  const img = $("input-img");
  img.onload = () => {
    const canvas = $("mask-canvas");
    canvas.width = img.naturalWidth;
    canvas.height = img.naturalHeight;
    canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height);
    canvas.hidden = task() !== "inpaint";
  };
  img.onerror = () => showError("The browser cannot show this file; the service may still read it (TIFF, 16-bit).");
  img.src = state.inputUrl;
  $("run").disabled = false;
  showError("");
}

// --- mask painting: strokes on a canvas with the image's own pixel size ---------------------------

function paintAt(event) {
  const canvas = $("mask-canvas");
  const rect = canvas.getBoundingClientRect();
  const x = ((event.clientX - rect.left) / rect.width) * canvas.width;
  const y = ((event.clientY - rect.top) / rect.height) * canvas.height;
  const radius = (Number($("brush").value) / rect.width) * canvas.width;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "rgba(255, 0, 0, 0.6)";
  ctx.beginPath();
  ctx.arc(x, y, radius / 2, 0, 2 * Math.PI);
  ctx.fill();
  state.painted = true;
}

function setupPainting() {
  const canvas = $("mask-canvas");
  let down = false;
  canvas.addEventListener("pointerdown", (e) => { down = true; canvas.setPointerCapture(e.pointerId); paintAt(e); });
  canvas.addEventListener("pointermove", (e) => { if (down) paintAt(e); });
  canvas.addEventListener("pointerup", () => { down = false; });
  $("clear-mask").addEventListener("click", () => {
    canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height);
    state.painted = false;
  });
}

function paintedMask() {
  // the painted strokes as a black-and-white PNG: white (non-zero) = missing
  const source = $("mask-canvas");
  const out = document.createElement("canvas");
  out.width = source.width;
  out.height = source.height;
  const ctx = out.getContext("2d");
  ctx.fillStyle = "black";
  ctx.fillRect(0, 0, out.width, out.height);
  const pixels = source.getContext("2d").getImageData(0, 0, source.width, source.height);
  const mask = ctx.getImageData(0, 0, out.width, out.height);
  for (let i = 3; i < pixels.data.length; i += 4) {
    if (pixels.data[i] > 0) mask.data[i - 3] = mask.data[i - 2] = mask.data[i - 1] = 255;
  }
  ctx.putImageData(mask, 0, 0);
  return new Promise((resolve) => out.toBlob(resolve, "image/png"));
}

// --- the request -----------------------------------------------------------------------------------

async function buildForm() {
  const form = new FormData();
  form.append("image", state.file, state.file.name);
  if ($("model").value) form.append("model", $("model").value);
  if (task() === "denoise" && !$("sigma-auto").checked) form.append("sigma", $("sigma").value);
  if (task() === "segment") {
    if (!$("threshold-auto").checked) form.append("threshold", $("threshold").value);
    form.append("output", $("output").value);
  }
  if (task() === "inpaint") {
    const maskFile = $("mask-file").files[0];
    if (maskFile) form.append("mask", maskFile, maskFile.name);
    else if (state.painted) form.append("mask", await paintedMask(), "mask.png");
  }
  return form;
}

async function run(event) {
  event.preventDefault();
  if (!state.file) return;
  showError("");
  $("run").disabled = true;
  $("run").textContent = "Solving…";
  const started = performance.now();
  try {
    const response = await fetch(`/${task()}`, {
      method: "POST",
      body: await buildForm(),
      headers: { Accept: "application/json", ...authHeaders() },
    });
    const elapsed = performance.now() - started;
    if (response.status === 401) {
      askForKey(await describeError(response));
      return;
    }
    if (!response.ok) {
      showError(await describeError(response));
      return;
    }
    showResult(await response.json(), elapsed);
  } catch (err) {
    showError(`The request failed: ${err.message}`);
  } finally {
    $("run").disabled = false;
    $("run").textContent = "Run";
  }
}

function showResult(body, elapsedMs) {
  const url = `data:image/png;base64,${body.image}`;
  state.resultUrl = url;
  $("result-img").src = url;
  $("compare-before").src = state.inputUrl;
  $("compare-after").src = url;
  $("compare").hidden = false;
  updateCompare();
  $("stat-model").textContent = body.model;
  $("stat-iterations").textContent = body.solver.iterations;
  $("stat-residual").textContent = body.solver.residual === null ? "not finite" : body.solver.residual.toExponential(2);
  $("stat-converged").textContent = body.solver.converged ? "yes" : "no — the best iterate is shown";
  $("stat-converged").className = body.solver.converged ? "ok" : "bad";
  if (body.sigma !== null) {
    $("stat-extra-name").textContent = "σ (0–255)";
    $("stat-extra").textContent = body.sigma.toFixed(2);
  } else if (body.threshold !== null) {
    $("stat-extra-name").textContent = "Threshold";
    $("stat-extra").textContent = body.threshold.toFixed(3);
  } else {
    $("stat-extra-name").textContent = "λ";
    $("stat-extra").textContent = body.lam.toPrecision(3);
  }
  $("stat-time").textContent =
    `${Math.round(elapsedMs)} ms in the browser (server: ${Math.round(body.timings.total_seconds * 1000)} ms, ` +
    `solve ${Math.round(body.timings.inference_seconds * 1000)} ms)`;
  $("stats").hidden = false;
  const link = $("download");
  link.href = url;
  link.download = `kdeq-${task()}-${state.file.name.replace(/\.[^.]*$/, "")}.png`;
  link.hidden = false;
}

function updateCompare() {
  // the clipped "after" image keeps the full width of the "before" one, so the two line up
  $("compare-after").style.width = `${$("compare-before").clientWidth}px`;
  $("compare-after-clip").style.width = `${$("compare-slider").value}%`;
}

function setup() {
  for (const radio of document.querySelectorAll("input[name=task]")) radio.addEventListener("change", showOptions);
  $("file").addEventListener("change", () => setFile($("file").files[0]));
  const drop = $("drop");
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    setFile(e.dataTransfer.files[0]);
  });
  $("sigma-auto").addEventListener("change", () => { $("sigma").disabled = $("sigma-auto").checked; });
  $("sigma").addEventListener("input", () => { $("sigma-value").textContent = $("sigma").value; });
  $("threshold-auto").addEventListener("change", () => { $("threshold").disabled = $("threshold-auto").checked; });
  $("threshold").addEventListener("input", () => {
    $("threshold-value").textContent = Number($("threshold").value).toFixed(2);
  });
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem("kdeq-api-key", $("api-key").value.trim());
    showError("");
    loadModels();
  });
  $("compare-slider").addEventListener("input", updateCompare);
  $("compare-before").addEventListener("load", updateCompare);
  window.addEventListener("resize", updateCompare);
  $("form").addEventListener("submit", run);
  setupPainting();
  showOptions();
  refreshStatus();
  loadModels();
}

document.addEventListener("DOMContentLoaded", setup);
