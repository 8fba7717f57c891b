// flashserve dashboard (GET /dashboard). Plain script, no build step.
//
// Polls the server's own data routes, one round (/health, /memory, /cache/stats,
// /metrics) a second at most, never while the tab is hidden. Time charts are
// drawn by uPlot (bundled: /dashboard/uPlot.iife.min.js); the bars, the layer
// strip and the heat map are plain elements and a canvas. Every shown number
// is also in a data-* attribute, so a test can read the page.
"use strict";

(() => {
  const KEY_STORAGE = "flashserve.apiKey";
  const PERIOD_MS = 1000;
  const WINDOW_S = 600; // time charts: the last 10 minutes
  const HEAT_COLUMNS = 120; // heat map: the last 120 polls
  const PARTS = [
    ["non_layer", "non-layer weights"],
    ["layers", "resident layers"],
    ["experts", "expert cache"],
    ["prompt", "prompt cache"],
    ["kv", "KV cache"],
    ["buffers", "streaming buffers"],
    ["rest", "rest of the process"],
  ];

  const $ = (id) => document.getElementById(id);
  // Several models: the page shows one, `?model=` in its own address (the server's
  // default, the --model or the most recently used, without it).
  const model = new URLSearchParams(location.search).get("model");
  const scoped = (path) => (model ? path + "?model=" + encodeURIComponent(model) : path);
  let apiKey = sessionStorage.getItem(KEY_STORAGE);
  let info = null;
  let prev = null; // the last poll's cumulative counters
  let timer = null;
  let inFlight = false;
  let lastStart = 0;
  let waitingForKey = false;

  // Time series, one array per line; s.t is unix seconds.
  const s = {
    t: [], tps: [], ttft: [],
    active: [], queued: [], batch: [],
    rss: [], weights: [], experts: [], kvPrompt: [],
    hit: [], served: [], ioWait: [],
  };
  const heat = { layers: [], columns: [] }; // a column per poll: served per MoE layer
  let shedTimes = [];

  class KeyNeeded extends Error {}

  // ---- fetching --------------------------------------------------------------

  async function get(path, asText) {
    const headers = apiKey ? { Authorization: "Bearer " + apiKey } : {};
    const response = await fetch(path, { headers, cache: "no-store" });
    if (response.status === 401) throw new KeyNeeded(path);
    if (!response.ok) {
      const error = new Error(path + " answered " + response.status);
      error.status = response.status;
      throw error;
    }
    return asText ? response.text() : response.json();
  }

  function schedule() {
    clearTimeout(timer);
    timer = null;
    if (document.hidden || waitingForKey || inFlight) return;
    timer = setTimeout(poll, Math.max(0, lastStart + PERIOD_MS - performance.now()));
  }

  async function poll() {
    timer = null;
    if (document.hidden || waitingForKey || inFlight) return;
    inFlight = true;
    lastStart = performance.now();
    // Every request of the round leaves now, so no route is asked twice within a second.
    const results = await Promise.allSettled([
      fetch("/health", { cache: "no-store" }).then((r) => r.json()), // open: no key
      get(scoped("/memory")),
      get(scoped("/cache/stats")),
      get("/metrics", true),
      info === null ? get(scoped("/dashboard/info")) : Promise.resolve(info),
    ]);
    try {
      const health = results[0].status === "fulfilled" ? results[0].value : null;
      if (health && health.status !== "ok") {
        setStatus("loading", "model " + health.status);
        return;
      }
      if (health && health.models) {
        const loaded = health.models.filter((m) => m.state === "loaded").map((m) => m.id);
        showPicker(loaded, info ? info.model : model);
        if (!loaded.length || (model && !loaded.includes(model))) {
          const what = model ? "model " + model + " is not loaded" : "no model is loaded";
          setStatus("loading", what + " (models load on their first request)");
          return;
        }
      }
      const failed = results.filter((r) => r.status === "rejected").map((r) => r.reason);
      if (failed.length) throw failed.find((e) => e instanceof KeyNeeded) || failed[0];
      const [, memory, cache, metrics, about] = results.map((r) => r.value);
      if (info === null) showInfo((info = about));
      update(health, memory, cache, parseMetrics(metrics));
      setStatus("ok", "updated " + new Date().toLocaleTimeString());
    } catch (error) {
      if (error instanceof KeyNeeded) {
        askForKey();
      } else {
        setStatus("error", String(error.message || error));
      }
    } finally {
      inFlight = false;
      schedule();
    }
  }

  document.addEventListener("visibilitychange", () => {
    if (document.hidden) {
      clearTimeout(timer);
      timer = null;
      setStatus("paused", "paused while the tab is hidden");
    } else {
      schedule();
    }
  });

  // ---- the API key -------------------------------------------------------------

  function askForKey() {
    const tried = apiKey !== null;
    apiKey = null;
    sessionStorage.removeItem(KEY_STORAGE);
    waitingForKey = true;
    $("key-message").textContent = tried ? "That key was refused." : "";
    $("key-form").hidden = false;
    $("key-input").focus();
    setStatus("key", "waiting for the API key");
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("key-input").value.trim();
    if (!value) return;
    apiKey = value;
    sessionStorage.setItem(KEY_STORAGE, value);
    $("key-input").value = "";
    $("key-form").hidden = true;
    waitingForKey = false;
    info = null;
    schedule();
  });

  // ---- parsing -----------------------------------------------------------------

  // Prometheus text -> {metric name: sum over its label sets}.
  function showPicker(loaded, current) {
    const pick = $("model-pick");
    const names = [...new Set([...loaded, ...(current ? [current] : [])])];
    if (pick.dataset.names !== names.join("\n")) {
      pick.dataset.names = names.join("\n");
      pick.replaceChildren(...names.map((n) => new Option(n, n, false, n === current)));
    }
    pick.hidden = names.length < 2;
  }

  $("model-pick").addEventListener("change", (event) => {
    location.search = "?model=" + encodeURIComponent(event.target.value); // a fresh page
  });

  function parseMetrics(text) {
    const out = {};
    const mine = info ? 'model="' + info.model + '"' : null;
    for (const line of text.split("\n")) {
      if (!line || line[0] === "#") continue;
      const space = line.lastIndexOf(" ");
      const key = line.slice(0, space);
      const brace = key.indexOf("{");
      const name = brace < 0 ? key : key.slice(0, brace);
      // Each model's engine numbers carry its label: only the shown model's count.
      if (mine && key.includes('model="') && !key.includes(mine)) continue;
      const value = parseFloat(line.slice(space + 1));
      if (Number.isFinite(value)) out[name] = (out[name] || 0) + value;
    }
    return out;
  }

  // ---- formatting --------------------------------------------------------------

  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) {
      n /= 1024;
      i += 1;
    }
    return (i === 0 ? n.toFixed(0) : n.toFixed(n < 10 ? 2 : 1)) + " " + units[i];
  }
  const pct = (x) => (x === null || x === undefined ? "-" : (100 * x).toFixed(1) + "%");
  const num = (x, digits) => (x === null || x === undefined ? "-" : x.toFixed(digits));

  function setValue(id, value, text) {
    const el = $(id);
    el.dataset.value = value === null || value === undefined ? "" : String(value);
    el.textContent = text;
  }

  function setStatus(state, text) {
    const el = $("status");
    el.dataset.state = state;
    el.textContent = text;
  }

  // ---- one poll ------------------------------------------------------------------

  function update(health, memory, cache, metrics) {
    const now = Date.now() / 1000;
    const stats = health.stats || {};
    const cur = counters(memory, cache, metrics);
    if (prev && ["itl", "ttftCount", "accesses"].some((k) => cur[k] < prev[k])) {
      prev = null; // the server restarted: its counters began again
      info = null; // and it may serve another model now
    }
    const dt = prev ? now - prev.t : 0;
    const d = (key) => (prev && dt > 0 ? cur[key] - prev[key] : null);

    // Generation: decode tokens are the tokens after each request's first.
    const decoded = d("itl");
    const firsts = d("ttftCount");
    const tps = decoded === null ? null : decoded / dt;
    const ttft = firsts ? d("ttftSum") / firsts : null;
    push(now, {
      tps, ttft,
      active: stats.active, queued: health.queued, batch: stats.batch_size,
      rss: memory.rss_bytes / 2 ** 20,
      weights: memory.resident_weight_bytes / 2 ** 20,
      experts: cache.enabled ? cache.occupancy_bytes / 2 ** 20 : null,
      kvPrompt: (memory.kv_cache_bytes + memory.prompt_cache_bytes) / 2 ** 20,
      hit: ratio(d("hits"), d("accesses")),
      served: ratio(d("served"), d("accesses")),
      ioWait: d("tokenSeconds") > 0 ? Math.min(1, d("blocked") / d("tokenSeconds")) : null,
    });
    if (tps !== null) setValue("tokens-per-s", tps, num(tps, 1));
    setValue("decode-tps", stats.last_decode_tokens_per_s, num(stats.last_decode_tokens_per_s, 1));
    const lastTtft = lastOf(s.ttft);
    setValue("ttft", lastTtft, lastTtft === null ? "-" : num(lastTtft, 3) + " s");
    setValue("active", stats.active, String(stats.active));
    setValue("queued", health.queued, String(health.queued));
    setValue("batch-size", stats.batch_size, String(stats.batch_size));
    // Speculative decoding since start (engine/speculative/): "off" until a pass ran.
    const spec = stats.speculative || {};
    const specRan = spec.passes > 0;
    setValue("spec-accepted", specRan ? spec.acceptance_rate : null,
      specRan ? num(100 * spec.acceptance_rate, 0) + " %" : "off");
    setValue("spec-tokens-per-pass", specRan ? spec.tokens_per_pass : null,
      specRan ? num(spec.tokens_per_pass, 2) : "-");

    shedTimes = memory.shedding_events.map((e) => e.time);
    showMemory(memory, cache);
    showResidency(memory, cache);
    showExperts(cache, cur);
    drawCharts();
    prev = { ...cur, t: now };
  }

  function counters(memory, cache, metrics) {
    const total = cache.enabled ? cache.since_start : null;
    const layers = total && total.layers ? total.layers : [];
    return {
      itl: metrics.flashserve_inter_token_latency_seconds_count || 0,
      ttftCount: metrics.flashserve_time_to_first_token_seconds_count || 0,
      ttftSum: metrics.flashserve_time_to_first_token_seconds_sum || 0,
      hits: total ? total.hits : 0,
      served: total ? total.hits + total.prefetch_hits : 0,
      accesses: total ? total.hits + total.prefetch_hits + total.misses : 0,
      blocked: total ? total.blocked_s : 0,
      tokenSeconds: total ? total.token_seconds : 0,
      layerServed: layers.map((l) => l.hits + l.prefetch_hits),
    };
  }

  const ratio = (a, b) => (a === null || !b ? null : a / b);
  const lastOf = (array) => {
    for (let i = array.length - 1; i >= 0; i -= 1) if (array[i] !== null) return array[i];
    return null;
  };

  function push(t, values) {
    s.t.push(t);
    for (const [key, value] of Object.entries(values)) {
      s[key].push(value === undefined ? null : value);
    }
    while (s.t.length && s.t[0] < t - WINDOW_S) {
      for (const array of Object.values(s)) array.shift();
    }
  }

  // ---- memory ----------------------------------------------------------------------

  function showMemory(memory, cache) {
    const part = {
      non_layer: memory.non_layer_bytes,
      layers: Math.max(0, memory.resident_weight_bytes - memory.non_layer_bytes),
      experts: cache.enabled ? cache.occupancy_bytes : 0,
      prompt: memory.prompt_cache_bytes,
      kv: memory.kv_cache_bytes,
      buffers: memory.streaming_buffer_bytes,
    };
    const known = Object.values(part).reduce((a, b) => a + b, 0);
    part.rest = Math.max(0, memory.rss_bytes - known);
    const total = known + part.rest;
    const limit = memory.memory_limit_bytes;
    fillBar($("memory-bar"), part, Math.max(limit, total));
    fillBar($("memory-breakdown"), part, total);
    const legend = $("memory-legend");
    legend.replaceChildren(
      ...PARTS.map(([key, label]) => {
        const row = document.createElement("tr");
        row.dataset.part = key;
        row.dataset.bytes = String(part[key]);
        const swatch = document.createElement("span");
        swatch.className = "swatch " + key;
        row.append(cell(swatch), cell(label), cell(bytes(part[key]), "bytes"));
        return row;
      }),
    );
    $("memory-caption").textContent =
      "process " + bytes(memory.rss_bytes) + " of a " + bytes(limit) + " limit (" +
      memory.memory_limit_source + "), " + bytes(memory.system_available_bytes) +
      " available; top bar: against the limit, lower bar: the process";
    $("memory-bar").dataset.limit = String(limit);
    const events = $("shed-events");
    events.replaceChildren(
      ...memory.shedding_events.slice(-10).map((e) => {
        const li = document.createElement("li");
        li.dataset.time = String(e.time);
        li.textContent =
          new Date(e.time * 1000).toLocaleTimeString() + ": available " +
          bytes(e.available_bytes) + " < floor " + bytes(e.floor_bytes) +
          (e.shed_layers.length ? "; shed layers " + e.shed_layers.join(", ") : "") +
          (e.freed_by_hooks ? "; caches gave back " + bytes(e.freed_by_hooks) : "");
        return li;
      }),
    );
  }

  function cell(content, className) {
    const td = document.createElement("td");
    if (className) td.className = className;
    td.append(content);
    return td;
  }

  function fillBar(bar, part, scale) {
    bar.replaceChildren(
      ...PARTS.map(([key, label]) => {
        const seg = document.createElement("div");
        seg.className = "seg";
        seg.dataset.part = key;
        seg.dataset.bytes = String(part[key]);
        seg.title = label + ": " + bytes(part[key]);
        seg.style.width = (scale > 0 ? (100 * part[key]) / scale : 0) + "%";
        return seg;
      }),
    );
  }

  // ---- residency strip ---------------------------------------------------------------

  function showResidency(memory, cache) {
    const resident = new Set(memory.resident_layers);
    const expertReads = {};
    if (cache.enabled && cache.since_start.layers) {
      for (const l of cache.since_start.layers) expertReads[l.layer] = l.bytes_read;
    }
    const reads = [];
    for (let i = 0; i < memory.num_layers; i += 1) {
      reads.push((memory.layer_bytes_read[i] || 0) + (expertReads[i] || 0));
    }
    const most = Math.max(1, ...reads);
    const strip = $("residency-strip");
    strip.replaceChildren(
      ...reads.map((read, i) => {
        const el = document.createElement("div");
        el.className = "cell";
        el.dataset.layer = String(i);
        el.dataset.state = resident.has(i) ? "resident" : "streamed";
        el.dataset.readBytes = String(read);
        el.title =
          "layer " + i + ": " + el.dataset.state + ", read " + bytes(memory.layer_bytes_read[i] || 0) +
          " (layer file) + " + bytes(expertReads[i] || 0) + " (experts) since start";
        const index = document.createElement("span");
        index.className = "index";
        index.textContent = memory.num_layers <= 48 ? String(i) : "";
        const fill = document.createElement("div");
        fill.className = "fill";
        fill.style.height = (100 * read) / most + "%";
        const area = document.createElement("div");
        area.className = "area";
        area.append(fill);
        el.append(index, area);
        return el;
      }),
    );
    $("residency-caption").textContent =
      memory.resident_layers.length + " of " + memory.num_layers + " decoder layers resident, " +
      memory.streamed_layers.length + " streamed";
  }

  // ---- expert cache ------------------------------------------------------------------

  function showExperts(cache, cur) {
    if (!cache.enabled) {
      $("experts-caption").textContent = "off: no expert cache on this model";
      return;
    }
    const w = cache.window;
    setValue("hit-rate", w.hit_rate, pct(w.hit_rate));
    setValue("served-rate", w.served_without_demand_read, pct(w.served_without_demand_read));
    setValue(
      "occupancy",
      cache.occupancy_fraction,
      pct(cache.occupancy_fraction) + " (" + bytes(cache.occupancy_bytes) + ")",
    );
    setValue("disk-gbps", w.read_gb_per_s, num(w.read_gb_per_s, 2));
    setValue("io-wait", w.io_wait_share, pct(w.io_wait_share));
    const size = cache.capacity_slots !== null
      ? cache.capacity_slots + " slots"
      : bytes(cache.capacity_bytes);
    $("experts-caption").textContent =
      size + " of " + cache.total_experts + " experts, " + cache.policy + ", prefetch " +
      cache.prefetch;

    heat.layers = cache.moe_layers;
    if (prev && prev.layerServed.length === cur.layerServed.length) {
      heat.columns.push(cur.layerServed.map((v, i) => v - prev.layerServed[i]));
      while (heat.columns.length > HEAT_COLUMNS) heat.columns.shift();
    }
    drawHeat();
  }

  function drawHeat() {
    const canvas = $("heatmap");
    const rows = heat.layers.length;
    if (!rows) return;
    canvas.style.height = Math.max(60, Math.min(400, rows * 8)) + "px";
    const ratio = window.devicePixelRatio || 1;
    const width = Math.max(1, Math.round(canvas.clientWidth * ratio));
    const height = Math.max(1, Math.round(canvas.clientHeight * ratio));
    if (canvas.width !== width || canvas.height !== height) {
      canvas.width = width;
      canvas.height = height;
    }
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#f4f5f8";
    ctx.fillRect(0, 0, width, height);
    let most = 0;
    let total = 0;
    for (const column of heat.columns) {
      for (const v of column) {
        most = Math.max(most, v);
        total += v;
      }
    }
    const cw = width / HEAT_COLUMNS;
    const rh = height / rows;
    const offset = HEAT_COLUMNS - heat.columns.length;
    heat.columns.forEach((column, c) => {
      column.forEach((v, r) => {
        if (!v) return;
        const x = v / most; // 0..1: pale yellow to deep red
        ctx.fillStyle = "hsl(" + (50 - 50 * x) + ", 90%, " + (85 - 45 * x) + "%)";
        ctx.fillRect((offset + c) * cw, r * rh, Math.ceil(cw), Math.ceil(rh));
      });
    });
    canvas.dataset.columns = String(heat.columns.length);
    canvas.dataset.max = String(most);
    canvas.dataset.total = String(total);
    const labels = $("heatmap-labels");
    if (labels.childElementCount !== rows) {
      const step = Math.ceil(rows / 12);
      labels.replaceChildren(
        ...heat.layers.map((layer, i) => {
          const span = document.createElement("span");
          span.textContent = i % step === 0 ? "L" + layer : "";
          return span;
        }),
      );
      labels.style.height = canvas.style.height;
    }
  }

  // ---- settings ----------------------------------------------------------------------

  function showInfo(data) {
    const set = data.settings;
    $("info-model").textContent = data.model;
    $("info-version").textContent = data.version;
    $("info-blas").textContent = data.blas;
    $("info-context").textContent = data.context_length + " tokens";
    let residency = set.residency;
    if (set.residency === "fixed") residency += ", " + set.resident_layers + " layers";
    if (set.memory_budget !== null) residency += ", budget " + bytes(set.memory_budget);
    $("info-residency").textContent = residency + ", " + set.placement;
    $("info-prefetch").textContent = set.prefetch_depth + " layer(s) ahead";
    $("info-expert-cache").textContent = set.expert_cache === null ? "off" : set.expert_cache;
    $("info-policy").textContent = set.expert_policy;
    $("info-expert-prefetch").textContent = set.expert_prefetch;
    $("info-max-batch").textContent = set.max_batch + " (queue " + set.max_queue + ")";
    $("info-prompt-cache").textContent =
      bytes(set.prompt_cache_bytes) + " memory, " + bytes(set.prompt_cache_disk_bytes) + " disk";
  }

  // ---- time charts (uPlot) -----------------------------------------------------------

  // Shedding events as dashed red lines on every time chart.
  const shedMarkers = {
    hooks: {
      draw: [
        (u) => {
          const ctx = u.ctx;
          const { left, top, width, height } = u.bbox;
          ctx.save();
          ctx.strokeStyle = "#d62728";
          ctx.lineWidth = 2 * (window.devicePixelRatio || 1);
          ctx.setLineDash([6, 4]);
          for (const t of shedTimes) {
            const x = u.valToPos(t, "x", true);
            if (x < left || x > left + width) continue;
            ctx.beginPath();
            ctx.moveTo(x, top);
            ctx.lineTo(x, top + height);
            ctx.stroke();
          }
          ctx.restore();
        },
      ],
    },
  };

  const CHARTS = {
    "chart-throughput": {
      keys: ["tps", "ttft"],
      series: [
        { label: "decode tok/s", stroke: "#3a6fd8", width: 2, scale: "tps" },
        { label: "TTFT s", stroke: "#e07b00", width: 2, scale: "s", points: { show: true } },
      ],
      axes: [{ scale: "tps", label: "tok/s" }, { scale: "s", side: 1, label: "TTFT s" }],
    },
    "chart-requests": {
      keys: ["active", "queued", "batch"],
      series: [
        { label: "active", stroke: "#3f8f4a", width: 2 },
        { label: "queued", stroke: "#d62728", width: 2 },
        { label: "batch size", stroke: "#9a60b4", width: 2 },
      ],
      axes: [{ label: "requests" }],
    },
    "chart-memory": {
      keys: ["rss", "weights", "experts", "kvPrompt"],
      series: [
        { label: "process MiB", stroke: "#6b7385", width: 2 },
        { label: "resident weights MiB", stroke: "#5470c6", width: 2 },
        { label: "expert cache MiB", stroke: "#d4a017", width: 2 },
        { label: "KV + prompt cache MiB", stroke: "#ee6666", width: 2 },
      ],
      axes: [{ label: "MiB" }],
    },
    "chart-experts": {
      keys: ["hit", "served", "ioWait"],
      series: [
        { label: "hit rate", stroke: "#3f8f4a", width: 2, value: (u, v) => pct(v) },
        { label: "served from memory", stroke: "#3a6fd8", width: 2, value: (u, v) => pct(v) },
        { label: "time waiting on I/O", stroke: "#d62728", width: 2, value: (u, v) => pct(v) },
      ],
      axes: [{ label: "share", values: (u, ticks) => ticks.map((v) => (100 * v).toFixed(0) + "%") }],
      range: [0, 1],
    },
  };
  const plots = {};
  const clock = (t) => new Date(t * 1000).toTimeString().slice(0, 8);
  const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600]; // whole seconds between ticks

  function makeChart(id, spec) {
    const el = $(id);
    const scales = { x: { time: true } };
    if (spec.range) scales.y = { range: spec.range };
    // Clock time only (the date row uPlot adds would crowd a 10-minute chart).
    const axes = [{ space: 70, incrs: TIME_STEPS, values: (u, ticks) => ticks.map(clock) }];
    for (const axis of spec.axes) {
      axes.push({ scale: axis.scale || "y", side: axis.side || 3, label: axis.label,
                  values: axis.values, size: 55 });
    }
    for (const serie of spec.series) {
      if (serie.scale && !scales[serie.scale]) scales[serie.scale] = { auto: true };
    }
    const options = {
      width: Math.max(300, el.clientWidth),
      height: el.classList.contains("short") ? 140 : 200,
      scales,
      axes,
      series: [{}, ...spec.series.map((x) => ({ spanGaps: false, ...x }))],
      plugins: [shedMarkers],
      legend: { live: true },
    };
    return new uPlot(options, [[], ...spec.keys.map(() => [])], el);
  }

  function drawCharts() {
    for (const [id, spec] of Object.entries(CHARTS)) {
      if (!plots[id]) plots[id] = makeChart(id, spec);
      plots[id].setData([s.t, ...spec.keys.map((k) => s[k])]);
      // data-max: the first line's highest point; data-max-any: any line's.
      const first = s[spec.keys[0]].filter((v) => v !== null);
      const all = spec.keys.flatMap((k) => s[k].filter((v) => v !== null));
      const el = $(id);
      el.dataset.points = String(first.length);
      el.dataset.max = String(first.length ? Math.max(...first) : 0);
      el.dataset.maxAny = String(all.length ? Math.max(...all) : 0);
      const [from, to] = [s.t[0], s.t[s.t.length - 1]];
      el.dataset.sheds = String(shedTimes.filter((t) => t >= from && t <= to).length);
    }
  }

  window.addEventListener("resize", () => {
    for (const [id, plot] of Object.entries(plots)) {
      const el = $(id);
      plot.setSize({ width: Math.max(300, el.clientWidth), height: plot.height });
    }
    drawHeat();
  });

  poll();
})();
