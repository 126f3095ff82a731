// The kdeq page: pick a task and an image, call the API with Accept: application/json, show the input
// and the result side by side and under a before/after slider, with the solver's statistics.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { file: null, inputUrl: null, painted: false, paintable: false, models: [], last: null };

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
  // polls until the service is ready (models load in the background), then lists the models
  let ready = false;
  try {
    const response = await fetch("/readyz");
    const body = await response.json();
    ready = response.ok;
    $("status").textContent = ready ? "ready" : `not ready: ${body.status}`;
    $("status").className = ready ? "status ok" : "status bad";
  } catch (err) {
    $("status").textContent = "the service does not answer";
    $("status").className = "status bad";
  }
  if (ready) loadModels();
  else setTimeout(refreshStatus, 2000);
}

async function loadModels() {
  try {
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
  } catch (err) {
    showError(`Could not list the models: ${err.message}`);
  }
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
  $("mask-canvas").hidden = task() !== "inpaint" || !state.paintable;
  fillModels();
  clearResult();
}

function clearResult() {
  state.last = null;
  for (const id of ["compare", "stats", "download"]) $(id).hidden = true;
  $("result-img").removeAttribute("src");
}

function setFile(file) {
  if (!file) return;
  state.file = file;
  state.painted = false;
  state.paintable = false;
  $("filename").textContent = `${file.name} (${Math.round(file.size / 1024)} kB)`;
  if (state.inputUrl) URL.revokeObjectURL(state.inputUrl);
  state.inputUrl = URL.createObjectURL(file);
  $("mask-file").value = "";
  $("paint-note").hidden = true;
  clearResult();
  const img = $("input-img");
  img.onload = () => {
    const canvas = $("mask-canvas");
    canvas.width = img.naturalWidth;
    canvas.height = img.naturalHeight;
    canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height);
    state.paintable = true;
    canvas.hidden = task() !== "inpaint";
  };
  img.onerror = () => {
    // TIFF or 16-bit files: the service reads them, the browser cannot draw them
    $("mask-canvas").hidden = true;
    $("paint-note").hidden = false;
    img.removeAttribute("src");
  };
  img.src = state.inputUrl;
  $("run").disabled = false;
  showError("");
}

// --- mask painting: strokes on a canvas with the image's own pixel size ---------------------------

function canvasPoint(event) {
  const canvas = $("mask-canvas");
  const rect = canvas.getBoundingClientRect();
  return {
    x: ((event.clientX - rect.left) / rect.width) * canvas.width,
    y: ((event.clientY - rect.top) / rect.height) * canvas.height,
    scale: canvas.width / rect.width,
  };
}

function setupPainting() {
  const canvas = $("mask-canvas");
  let last = null;
  const stroke = (event) => {
    // a line from the previous point, so fast strokes leave no gaps
    const p = canvasPoint(event);
    const ctx = canvas.getContext("2d");
    ctx.strokeStyle = ctx.fillStyle = "rgba(255, 0, 0, 0.6)";
    ctx.lineWidth = Number($("brush").value) * p.scale;
    ctx.lineCap = ctx.lineJoin = "round";
    ctx.beginPath();
    ctx.moveTo((last || p).x, (last || p).y);
    ctx.lineTo(p.x + 0.01, p.y);
    ctx.stroke();
    last = p;
    state.painted = true;
  };
  canvas.addEventListener("pointerdown", (e) => { canvas.setPointerCapture(e.pointerId); last = null; stroke(e); });
  canvas.addEventListener("pointermove", (e) => { if (last) stroke(e); });
  canvas.addEventListener("pointerup", () => { last = null; });
  $("clear-mask").addEventListener("click", () => {
    canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height);
    state.painted = false;
    $("mask-file").value = "";
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
  const request = { task: task(), file: state.file, inputUrl: state.inputUrl };
  state.last = request;
  $("run").disabled = true;
  $("run").textContent = "Solving…";
  const started = performance.now();
  try {
    const response = await fetch(`/${request.task}`, {
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
    const body = await response.json();
    if (state.last === request) showResult(body, elapsed, request);  // not if the input changed since
  } catch (err) {
    showError(`The request failed: ${err.message}`);
  } finally {
    $("run").disabled = false;
    $("run").textContent = "Run";
  }
}

function showResult(body, elapsedMs, request) {
  const url = `data:image/png;base64,${body.image}`;
  $("result-img").src = url;
  $("compare-before").src = request.inputUrl;
  $("compare-after").src = url;
  $("compare").hidden = !state.paintable;  // the browser could draw the input
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
  link.download = `kdeq-${request.task}-${request.file.name.replace(/\.[^.]*$/, "")}.png`;
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
  drop.addEventListener("keydown", (e) => {
    if (e.key === "Enter" || e.key === " ") { e.preventDefault(); $("file").click(); }
  });
  // a file dropped beside the zone must not replace the page
  for (const kind of ["dragover", "drop"]) document.addEventListener(kind, (e) => e.preventDefault());
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
}

document.addEventListener("DOMContentLoaded", setup);
