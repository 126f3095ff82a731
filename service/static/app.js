// The kdeq page: pick a task and an image, call the API with Accept: application/json, show the input
// and the result side by side and under a before/after slider, with the solver's statistics.
//
// Nothing here names a task: the task radios, their option controls and the result fields are built
// from GET /tasks (each task's options as a JSON schema, its file inputs and its result fields), so a
// newly registered task appears without editing the page. The only special cases are keyed on what an
// input *is*: a file of kind "mask" is painted on the input image, and an option registered in
// WIDGETS (the deblurrer's `psf`) gets its own control.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  file: null, inputUrl: null, inputSize: null, painted: false, paintable: false,
  models: [], tasks: [], blocks: new Map(), last: null,
};
const IMAGE_TYPES = "image/png,image/jpeg,image/webp,image/tiff";

// --- small helpers -------------------------------------------------------------------------------

function el(tag, props = {}, ...children) {
  // a DOM element: properties set directly, aria-*/data-* as attributes (no innerHTML: the CSP and
  // the server's descriptions stay out of the markup)
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value === undefined || value === null) continue;
    if (key.startsWith("aria-") || key.startsWith("data-")) node.setAttribute(key, value);
    else node[key] = value;
  }
  node.append(...children);
  return node;
}

function richText(text) {
  // the API's descriptions quote names in `backticks`: show those as code
  return (text || "").split("`").map((part, i) => (i % 2 ? el("code", {}, part) : part));
}

function capitalise(text) {
  return text ? text[0].toUpperCase() + text.slice(1) : "";
}

function splitDefault(description) {
  // "noise level on the 0–255 scale (default: estimated)" -> the text and "estimated"
  const match = /\s*\(default: ([^)]*)\)\s*$/.exec(description || "");
  return match
    ? { text: description.slice(0, match.index), byDefault: match[1] }
    : { text: description || "", byDefault: null };
}

let uid = 0;
function hintFor(input, text) {
  // a hint paragraph that the input's accessible description points to (none without a text)
  if (!text) return "";
  const hint = el("p", { className: "hint", id: `hint-${++uid}` }, ...richText(text));
  input.setAttribute("aria-describedby", hint.id);
  return hint;
}

function task() {
  const radio = document.querySelector("input[name=task]:checked");
  return radio ? radio.value : null;
}

function block() {
  return state.blocks.get(task());
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

// --- the service: readiness, models, tasks --------------------------------------------------------

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
      askForKey("This server needs an API key to list its tasks and models and to run them.");
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

async function loadTasks() {
  // GET /tasks needs the key like /models: on 401 the key box asks for it and its change handler
  // calls this again; a server that cannot be reached (or is restarting) is asked again later
  let response;
  try {
    response = await fetch("/tasks", { headers: authHeaders() });
  } catch (err) {
    $("task-summary").textContent = `Could not list the tasks (${err.message}); trying again…`;
    setTimeout(loadTasks, 3000);
    return;
  }
  if (response.status === 401) {
    $("task-summary").textContent = "The tasks are listed once the API key is given.";
    askForKey("This server needs an API key to list its tasks and models and to run them.");
    return;
  }
  if (response.status >= 500) {
    $("task-summary").textContent = `Could not list the tasks (${response.status}); trying again…`;
    setTimeout(loadTasks, 3000);
    return;
  }
  let tasks = null;
  if (response.ok) tasks = await response.json().catch(() => null);
  if (!Array.isArray(tasks) || !tasks.length) {
    // an older server without /tasks, or an answer this page cannot read: nothing can be run
    const why = response.ok ? "its answer lists no task" : await describeError(response);
    $("task-summary").textContent = "This server does not list its tasks, so the page cannot offer any.";
    showError(`GET /tasks: ${why}`);
    return;
  }
  fillTasks(tasks);
}

function fillModels() {
  const select = $("model");
  select.replaceChildren(new Option("default", ""));
  if (!state.models.length && block()) {
    // /models not (yet) read: the ready model ids that GET /tasks lists, without descriptions
    for (const id of block().task.models || []) select.add(new Option(id, id));
    return;
  }
  for (const m of state.models) {
    if (m.task !== task() || !m.ready) continue;
    select.add(new Option(`${m.id}${m.default ? " (default)" : ""} — ${m.description || ""}`, m.id));
  }
  updateUncertainty();
}

function updateUncertainty() {
  // the uncertainty box is offered for a model whose GET /models entry says it can answer it (the
  // Gaussian tasks' models and the segmenter, plug-and-play deblurrers excepted); "default" is the
  // task's default model
  const id = $("model").value;
  const model = state.models.find((m) => m.task === task() && (id ? m.id === id : m.default));
  const can = Boolean(model && model.uncertainty);
  $("uncertainty-box").hidden = !can;
  $("uncertainty").disabled = !can;
}

// --- the task list and its option blocks, from GET /tasks ----------------------------------------

// what the controls are built from: a task's list of ready models may change, its form does not
const formOf = (tasks) => JSON.stringify(tasks.map(({ models, ...form }) => form));

function fillTasks(tasks) {
  // a reload with the same forms (a new key, say) keeps the controls, their values and the result
  const same = state.tasks.length && formOf(tasks) === formOf(state.tasks);
  state.tasks = tasks;
  if (same) return;
  const keep = task();
  state.blocks = new Map(tasks.map((t) => [t.name, buildBlock(t)]));
  const fieldset = $("tasks");
  fieldset.replaceChildren(fieldset.querySelector("legend"));
  for (const t of tasks) {
    const radio = el("input", { type: "radio", name: "task", value: t.name });
    radio.addEventListener("change", showOptions);
    // the name is short enough for a row of radios; the summary is the title and the hint below
    fieldset.append(el("label", { title: t.summary }, radio, ` ${capitalise(t.name.replaceAll("_", " "))}`));
  }
  const chosen = fieldset.querySelector(`input[value="${CSS.escape(keep || "")}"]`) ||
    fieldset.querySelector("input[name=task]");
  chosen.checked = true;
  $("options").replaceChildren(...[...state.blocks.values()].map((b) => b.element));
  showOptions();
}

function resolve(schema, root) {
  // one option's schema as {type, enum, minimum, …, nullable}: pydantic writes `X | None` as
  // anyOf [X, {type: "null"}] and enum classes as a $ref into $defs
  const branches = schema.anyOf || [schema];
  let main = branches.find((b) => b.type !== "null") || {};
  if (main.$ref) main = (root.$defs || {})[main.$ref.split("/").pop()] || {};
  return { ...schema, ...main, nullable: branches.some((b) => b.type === "null") };
}

function buildBlock(t) {
  // a task's controls, each {element, append(form), reset?()}; a fieldset disabled while hidden, so
  // the browser's form validation checks only the shown task's inputs
  const b = { task: t, controls: [], paints: false, brush: null };
  const schema = t.options || {};
  const required = new Set(schema.required || []);
  const taken = new Set();  // file inputs a widget has taken over
  for (const [name, raw] of Object.entries(schema.properties || {})) {
    const spec = resolve(raw, schema);
    const widget = Object.hasOwn(WIDGETS, name) ? WIDGETS[name] : null;
    if (widget) {
      for (const file of widget.files) taken.add(file);
      b.controls.push(widget.build(t, spec));
    } else {
      b.controls.push(optionControl(t, name, spec, required.has(name)));
    }
  }
  for (const file of t.files || []) {
    if (taken.has(file.name)) continue;
    if (file.kind === "mask" && !b.paints) {
      // one canvas: the first mask input is painted, any other is a plain file input
      b.paints = true;
      const control = maskControl(t, file);
      b.brush = control.brush;
      b.controls.push(control);
    } else {
      b.controls.push(fileControl(t, file));
    }
  }
  b.element = el("fieldset", { className: "options", "data-task": t.name },
    el("legend", { className: "visually-hidden" }, `${t.name} options`),
    ...b.controls.map((c) => c.element));
  return b;
}

function showOptions() {
  for (const b of state.blocks.values()) {
    const shown = b.task.name === task();
    b.element.hidden = !shown;
    b.element.disabled = !shown;
  }
  const current = block();
  $("task-summary").textContent = current ? `${current.task.summary}.` : "";
  showPainting();
  fillModels();
  clearResult();
  updateRun();
}

function showPainting() {
  const paints = Boolean(block() && block().paints);
  $("mask-canvas").hidden = !paints || !state.paintable;
  $("paint-note").hidden = !paints || !state.file || state.paintable;
}

function updateRun() {
  $("run").disabled = !state.file || !block();
  $("sample").disabled = !block();
}

// --- generic controls, from an option's JSON schema ----------------------------------------------

function controlId(t, name) {
  return `${t.name}-${name}`;
}

function rangeText(spec) {
  const lo = spec.minimum ?? spec.exclusiveMinimum;
  const hi = spec.maximum ?? spec.exclusiveMaximum;
  if (lo !== undefined && hi !== undefined) return ` (${lo}–${hi})`;
  if (lo !== undefined) return spec.minimum !== undefined ? ` (≥ ${lo})` : ` (> ${lo})`;
  if (hi !== undefined) return spec.maximum !== undefined ? ` (≤ ${hi})` : ` (< ${hi})`;
  return "";
}

function optionControl(t, name, spec, required) {
  const title = spec.title || capitalise(name);
  const { text, byDefault } = splitDefault(spec.description);
  const id = controlId(t, name);
  const wrap = el("div", { className: "option", "data-inputs": name });
  const control = { element: wrap };
  // a value equal to the schema's default is left to the server, which applies that default itself
  // (and the request carries only what the user chose)
  const isDefault = (value) => value === "" || (spec.default !== undefined && spec.default !== null &&
    value === String(spec.default));

  if (spec.enum) {
    // a Literal: a select of its values; a nullable one may be left to the server's default
    const select = el("select", { id, name });
    if (spec.nullable) select.add(new Option(`default${byDefault ? ` (${byDefault})` : ""}`, ""));
    for (const value of spec.enum) select.add(new Option(String(value), String(value)));
    if (spec.default !== undefined && spec.default !== null) select.value = String(spec.default);
    wrap.append(el("label", { className: "field" }, title, select), hintFor(select, spec.description));
    control.append = (form) => { if (!isDefault(select.value)) form.append(name, select.value); };
    return control;
  }

  if (spec.type === "boolean") {
    const box = el("input", { id, name, type: "checkbox", checked: Boolean(spec.default) });
    wrap.append(el("label", { className: "field" }, box, ` ${title}`), hintFor(box, spec.description));
    control.append = (form) => { if (box.checked !== Boolean(spec.default)) form.append(name, String(box.checked)); };
    return control;
  }

  const numeric = spec.type === "number" || spec.type === "integer";
  const input = el("input", numeric
    ? { id, name, type: "number", step: spec.type === "integer" ? "1" : "any",
        min: spec.minimum ?? spec.exclusiveMinimum, max: spec.maximum ?? spec.exclusiveMaximum }
    : { id, name, type: "text", maxLength: spec.maxLength });
  if (spec.default !== undefined && spec.default !== null) input.value = String(spec.default);
  input.required = required || !spec.nullable;
  const label = el("label", { className: "field" }, `${title}${numeric ? rangeText(spec) : ""}`, input);

  if (spec.nullable && spec.default === null) {
    // left out, the server chooses (σ estimated, Otsu's threshold): a checkbox "use the default",
    // checked, keeps the value input disabled until the user wants to give one
    const auto = el("input", { id: `${id}-auto`, type: "checkbox", checked: true });
    input.disabled = input.required = true;  // required once enabled: an empty value would be an error
    auto.addEventListener("change", () => {
      input.disabled = auto.checked;
      if (!auto.checked) input.focus();
    });
    wrap.append(el("label", { className: "field" }, auto, ` use the default: ${byDefault || "chosen by the server"}`),
      label, hintFor(input, text));
    control.append = (form) => { if (!auto.checked) form.append(name, input.value); };
    return control;
  }
  wrap.append(label, hintFor(input, spec.description));
  control.append = (form) => { if (!isDefault(input.value)) form.append(name, input.value); };
  return control;
}

function fileControl(t, file) {
  // any other image input (kind "image"), sent when a file is chosen
  const input = el("input", { id: controlId(t, file.name), name: file.name, type: "file", accept: IMAGE_TYPES });
  const element = el("div", { className: "option", "data-inputs": file.name },
    el("label", { className: "field" }, capitalise(file.name.replaceAll("_", " ")), input),
    hintFor(input, file.description));
  return {
    element,
    append: (form) => { if (input.files[0]) form.append(file.name, input.files[0], input.files[0].name); },
  };
}

// --- a mask input: painted on the input image, or uploaded -----------------------------------------

function maskControl(t, file) {
  const id = controlId(t, file.name);
  const title = capitalise(file.name.replaceAll("_", " "));
  const brush = el("input", { id: `${id}-brush`, type: "range", min: 2, max: 60, value: 16 });
  const clear = el("button", { id: `${id}-clear`, type: "button", className: "secondary" }, `Clear the ${file.name}`);
  const input = el("input", { id, name: file.name, type: "file", accept: IMAGE_TYPES });
  clear.addEventListener("click", () => {
    clearCanvas();
    input.value = "";
  });
  const element = el("div", { className: "option", "data-inputs": file.name },
    el("p", { className: "hint" }, "Paint the pixels on the input image, or upload a file: ", ...richText(file.description), "."),
    el("label", { className: "field" }, "Brush ", brush),
    clear,
    el("label", { className: "field" }, `${title} file (used instead of painting) `, input));
  return {
    element,
    brush,
    reset: () => { input.value = ""; },  // a new input image: the old mask no longer fits it
    append: async (form) => {
      if (input.files[0]) form.append(file.name, input.files[0], input.files[0].name);
      else if (state.painted) form.append(file.name, await paintedMask(), `${file.name}.png`);
    },
  };
}

// --- task-specific widgets, by option name -------------------------------------------------------

// A widget replaces the generic control of the option it is registered under, and takes over the
// file inputs it names (they are not given a control of their own).
const WIDGETS = {
  psf: { files: ["psf_image"], build: psfWidget },
};

// the named PSFs of kdeq.maths.psf.parse_psf: `kind:P1[,P2]`, in this parameter order
const PSF_KINDS = {
  gaussian: { label: "Gaussian", params: [{ key: "sigma", label: "Width σ (pixels)", value: 1.6, min: 0.1 }] },
  disk: { label: "disk (defocus)", params: [{ key: "radius", label: "Radius (pixels)", value: 3, min: 0.5 }] },
  motion: {
    label: "motion",
    params: [
      { key: "length", label: "Length (pixels)", value: 9, min: 1 },
      { key: "angle", label: "Angle (degrees, counter-clockwise from horizontal)", value: 0, min: -360, max: 360 },
    ],
  },
};

function psfWidget(t, spec) {
  // a select of the named kinds with their parameters, composing `psf`, or (when the task takes a
  // `psf_image`) "upload a PSF image": the server needs exactly one of the two
  const id = controlId(t, "psf");
  const upload = (t.files || []).find((f) => f.name === "psf_image");
  const select = el("select", { id });
  const groups = {};
  const inputs = {};
  for (const [kind, { label, params }] of Object.entries(PSF_KINDS)) {
    select.add(new Option(label, kind));
    inputs[kind] = params.map((p) => el("input", {
      id: `${id}-${kind}-${p.key}`, type: "number", step: "any", min: p.min, max: p.max, value: p.value, required: true,
    }));
    groups[kind] = el("div", { className: "psf-params" },
      ...params.map((p, i) => el("label", { className: "field" }, p.label, inputs[kind][i])));
  }
  const wrap = el("div", { className: "option psf", "data-inputs": upload ? "psf psf_image" : "psf" });
  const preview = el("output", { id: `${id}-value` });
  wrap.append(el("label", { className: "field" }, "Blur (point-spread function)", select));
  let file = null;
  if (upload) {
    select.add(new Option("upload a PSF image", "upload"));
    file = el("input", { id: controlId(t, upload.name), name: upload.name, type: "file", accept: IMAGE_TYPES, required: true });
    groups.upload = el("div", { className: "psf-params" },
      el("label", { className: "field" }, "PSF image ", file), hintFor(file, upload.description));
  }
  const composed = () => {
    const kind = select.value;
    return `${kind}:${inputs[kind].map((input) => input.value).join(",")}`;
  };
  const update = () => {
    // only the chosen kind's inputs are enabled, so the form validates those alone
    for (const [kind, group] of Object.entries(groups)) {
      group.hidden = kind !== select.value;
      for (const input of group.querySelectorAll("input")) input.disabled = group.hidden;
    }
    preview.textContent = select.value === "upload" ? "psf_image = the uploaded file" : `psf = ${composed()}`;
  };
  select.addEventListener("change", update);
  wrap.addEventListener("input", update);
  // the hint shows the value actually sent; the option's description (its syntax) is the tooltip
  const sent = hintFor(select, "sent as ");
  sent.append(preview);
  select.title = spec.description || "";
  wrap.append(...Object.values(groups), sent);
  update();
  return {
    element: wrap,
    append: (form) => {
      if (select.value === "upload") form.append(upload.name, file.files[0], file.files[0].name);
      else form.append("psf", composed());
    },
  };
}

// --- the input image -------------------------------------------------------------------------------

function clearResult() {
  state.last = null;
  for (const id of ["compare", "stats", "history", "download", "actual-size-box", "uncertainty-view", "uncertainty-canvas"]) {
    $(id).hidden = true;
  }
  $("result-img").removeAttribute("src");
  $("result-size").textContent = "";
}

function setFile(file) {
  if (!file) return;
  state.file = file;
  state.painted = false;
  state.paintable = false;
  state.inputSize = null;
  $("filename").textContent = `${file.name} (${formatBytes(file.size)})`;
  $("input-size").textContent = "";
  if (state.inputUrl) URL.revokeObjectURL(state.inputUrl);
  state.inputUrl = URL.createObjectURL(file);
  for (const b of state.blocks.values()) for (const c of b.controls) if (c.reset) c.reset();
  clearResult();
  const img = $("input-img");
  img.onload = () => {
    const canvas = $("mask-canvas");
    canvas.width = img.naturalWidth;
    canvas.height = img.naturalHeight;
    canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height);
    state.paintable = true;
    state.inputSize = { width: img.naturalWidth, height: img.naturalHeight };
    $("input-size").textContent = `(${img.naturalWidth} × ${img.naturalHeight})`;
    showPainting();
  };
  img.onerror = () => {
    // TIFF or 16-bit files: the service reads them, the browser cannot draw them
    img.removeAttribute("src");
    showPainting();
  };
  img.src = state.inputUrl;
  showPainting();
  updateRun();
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

function clearCanvas() {
  const canvas = $("mask-canvas");
  canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height);
  state.painted = false;
}

function setupPainting() {
  const canvas = $("mask-canvas");
  let last = null;
  const stroke = (event) => {
    // a line from the previous point, so fast strokes leave no gaps
    const p = canvasPoint(event);
    const ctx = canvas.getContext("2d");
    const brush = block() && block().brush;
    ctx.strokeStyle = ctx.fillStyle = "rgba(255, 0, 0, 0.6)";
    ctx.lineWidth = Number(brush ? brush.value : 16) * p.scale;
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

async function buildForm(b) {
  const form = new FormData();
  form.append("image", state.file, state.file.name);
  if ($("model").value) form.append("model", $("model").value);
  for (const control of b.controls) await control.append(form);
  form.append("history", "true");  // the residual at each iteration, for the plot
  if (!$("uncertainty").disabled && $("uncertainty").checked) form.append("uncertainty", "true");
  return form;
}

async function run(event) {
  // the browser has checked the shown controls (min/max, required) before this submit event
  event.preventDefault();
  const b = block();
  if (!state.file || !b) return;
  showError("");
  const request = { task: b.task, file: state.file, inputUrl: state.inputUrl, inputSize: state.inputSize };
  state.last = request;
  $("run").disabled = true;
  $("run").textContent = "Solving…";
  const started = performance.now();
  try {
    const response = await fetch(b.task.route, {
      method: "POST",
      body: await buildForm(b),
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
    if (state.last === request) showResult(body, response.headers, elapsed, request);  // not if the input changed since
  } catch (err) {
    showError(`The request failed: ${err.message}`);
  } finally {
    updateRun();
    $("run").textContent = "Run";
  }
}

function showFields(body, headers, t) {
  // the task's result fields (σ used, threshold used, …) between "Converged" and "Size": the
  // X-KDEQ-* header, formatted by the server, or else the JSON value; λ when the task has none
  for (const node of document.querySelectorAll("#stats .result-field")) node.remove();
  const rows = (t.fields || []).map((f) => {
    const header = f.header ? headers.get(f.header) : null;
    const value = body[f.name];
    const text = header ?? (typeof value === "number" ? value.toPrecision(4) : "—");
    return [capitalise(f.description || f.name), text, `stat-${f.name}`];
  });
  if (!rows.length) rows.push(["λ", body.lam.toPrecision(3), "stat-lam"]);
  const before = $("stat-size-name");
  for (const [name, text, id] of rows) {
    before.before(el("dt", { className: "result-field" }, name), el("dd", { className: "result-field", id }, text));
  }
}

function showResult(body, headers, elapsedMs, request) {
  const url = `data:image/png;base64,${body.image}`;
  $("result-img").src = url;
  $("result-size").textContent = `(${body.width} × ${body.height})`;
  $("compare-before").src = request.inputUrl;
  $("compare-after").src = url;
  $("compare").hidden = !state.paintable;  // the browser could draw the input
  updateCompare();
  $("stat-model").textContent = body.model;
  $("stat-iterations").textContent = body.solver.iterations;
  $("stat-residual").textContent = body.solver.residual === null ? "not finite" : body.solver.residual.toExponential(2);
  $("stat-converged").textContent = body.solver.converged ? "yes" : "no — the best iterate is shown";
  $("stat-converged").className = body.solver.converged ? "ok" : "bad";
  showFields(body, headers, request.task);
  // the size, and the factor when the output is larger than the input (super-resolution)
  const input = request.inputSize;
  const grown = input && (input.width !== body.width || input.height !== body.height);
  $("stat-size").textContent = `${body.width} × ${body.height} px` +
    (grown ? ` (input ${input.width} × ${input.height}, ${(body.width / input.width).toPrecision(3)}×)` : "");
  // the result is scaled to fit beside the input; a larger one can be shown pixel for pixel
  $("actual-size-box").hidden = !(grown || body.width > $("result-stage").clientWidth);
  showActualSize();
  $("stat-time").textContent =
    `${Math.round(elapsedMs)} ms in the browser (server: ${Math.round(body.timings.total_seconds * 1000)} ms, ` +
    `solve ${Math.round(body.timings.inference_seconds * 1000)} ms)`;
  $("stats").hidden = false;
  showHistory(body.solver.history);
  showUncertainty(body.uncertainty, request);
  const link = $("download");
  link.href = url;
  link.download = `kdeq-${request.task.name}-${request.file.name.replace(/\.[^.]*$/, "")}.png`;
  link.hidden = false;
}

// the heat map's colour ramp: dark (certain) to bright (uncertain), [position, r, g, b]
const RAMP = [[0, 0, 0, 4], [1 / 3, 120, 28, 109], [2 / 3, 237, 105, 37], [1, 252, 255, 164]];

function heat(t) {
  const i = Math.min(RAMP.length - 2, Math.floor(t * (RAMP.length - 1)));
  const [p0, ...c0] = RAMP[i];
  const [p1, ...c1] = RAMP[i + 1];
  const f = Math.min(1, Math.max(0, (t - p0) / (p1 - p0)));
  return c0.map((c, k) => Math.round(c + f * (c1[k] - c)));
}

function showUncertainty(u, request) {
  // the posterior std (a 16-bit PNG whose value × scale is the std on [0, 1]) drawn as a heat map
  // over the result, scaled to its largest value, with a toggle and a legend in grey levels
  const canvas = $("uncertainty-canvas");
  $("uncertainty-view").hidden = !u;
  canvas.hidden = true;
  if (!u) return;
  const img = new Image();
  img.onload = () => {
    if (state.last !== request) return;  // a newer result replaced this one
    canvas.width = img.naturalWidth;
    canvas.height = img.naturalHeight;
    const ctx = canvas.getContext("2d");
    ctx.drawImage(img, 0, 0);
    const pixels = ctx.getImageData(0, 0, canvas.width, canvas.height);
    for (let i = 0; i < pixels.data.length; i += 4) {
      const [r, g, b] = heat(pixels.data[i] / 255);
      pixels.data.set([r, g, b, 215], i);
    }
    ctx.putImageData(pixels, 0, 0);
    canvas.dataset.drawn = "true";
    canvas.hidden = !$("show-uncertainty").checked;
  };
  canvas.dataset.drawn = "false";
  img.src = `data:image/png;base64,${u.png}`;
  const top = 65535 * u.scale * 255;  // the largest std, in grey levels of 255
  const how = u.exact ? "exact" : `estimated with ${u.probes} probes, about ${(100 * (u.error || 0)).toPrecision(2)} % error`;
  $("uncertainty-legend").replaceChildren(
    "posterior standard deviation: 0",
    el("span", { className: "ramp", "aria-hidden": "true" }),
    `${top.toPrecision(3)} grey levels of 255 (${how})`,
  );
}

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function showHistory(history) {
  // log10 of the relative residual against the iteration, scaled to the plot; hidden when the server
  // sent none (an image solved in tiles, a solver that records none) or a value was not finite
  const plot = $("history-plot");
  plot.replaceChildren();
  const values = (history || []).filter((v) => v !== null && v > 0);
  $("history").hidden = values.length === 0;
  if (!values.length) return;
  const [w, h, left, bottom, top] = [400, 160, 52, 22, 8];
  const logs = values.map(Math.log10);
  let lo = Math.floor(Math.min(...logs));
  let hi = Math.ceil(Math.max(...logs));
  if (hi === lo) { lo -= 1; hi += 1; }
  const x = (i) => left + (values.length === 1 ? 0 : (i / (values.length - 1)) * (w - left - 8));
  const y = (v) => top + ((hi - v) / (hi - lo)) * (h - top - bottom);
  plot.append(svg("line", { x1: left, y1: top, x2: left, y2: h - bottom, class: "axis" }));
  plot.append(svg("line", { x1: left, y1: h - bottom, x2: w - 8, y2: h - bottom, class: "axis" }));
  for (const v of [hi, lo]) {
    plot.append(svg("text", { x: left - 4, y: y(v) + 4, "text-anchor": "end", class: "tick" }, `1e${v}`));
  }
  plot.append(svg("text", { x: left, y: h - 6, class: "tick" }, "1"));
  plot.append(svg("text", { x: w - 8, y: h - 6, "text-anchor": "end", class: "tick" }, `${values.length}`));
  const points = logs.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
  plot.append(svg("polyline", { points, class: "residual" }));
  for (const [i, v] of logs.entries()) {
    plot.append(svg("circle", { cx: x(i).toFixed(1), cy: y(v).toFixed(1), r: 2.5, class: "step" }));
  }
}

async function trySample() {
  // the server's generated image for the task (GET /samples/TASK), as if it had been chosen
  const b = block();
  if (!b) return;
  showError("");
  try {
    const response = await fetch(`/samples/${encodeURIComponent(b.task.name)}`);
    if (!response.ok) {
      showError(await describeError(response));
      return;
    }
    const blob = await response.blob();
    setFile(new File([blob], `sample-${b.task.name}.png`, { type: "image/png" }));
  } catch (err) {
    showError(`The sample could not be loaded: ${err.message}`);
  }
}

function showActualSize() {
  $("result-stage").classList.toggle("actual", $("actual-size").checked && !$("actual-size-box").hidden);
}

function updateCompare() {
  // the clipped "after" image keeps the full width of the "before" one, so the two line up
  $("compare-after").style.width = `${$("compare-before").clientWidth}px`;
  $("compare-after-clip").style.width = `${$("compare-slider").value}%`;
}

function setup() {
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
  $("api-key").addEventListener("change", () => {
    // "change" fires again when the field loses focus: reload only for a new key
    const key = $("api-key").value.trim();
    if (key === apiKey() && state.tasks.length) return;
    sessionStorage.setItem("kdeq-api-key", key);
    showError("");
    loadTasks();
    loadModels();
  });
  $("actual-size").addEventListener("change", showActualSize);
  $("model").addEventListener("change", updateUncertainty);
  $("show-uncertainty").addEventListener("change", () => {
    const canvas = $("uncertainty-canvas");
    canvas.hidden = !$("show-uncertainty").checked || canvas.dataset.drawn !== "true";
  });
  $("compare-slider").addEventListener("input", updateCompare);
  $("compare-before").addEventListener("load", updateCompare);
  window.addEventListener("resize", updateCompare);
  $("form").addEventListener("submit", run);
  $("sample").addEventListener("click", trySample);
  setupPainting();
  loadTasks();
  refreshStatus();
}

document.addEventListener("DOMContentLoaded", setup);
