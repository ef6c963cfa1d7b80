// pagedserve dashboard: polls <base>/state about once a second and redraws in place.
// Plain JS, no dependencies, no build step. Data from the server is only ever
// inserted as text (textContent), never as HTML.
(function () {
  "use strict";

  const BASE = document.querySelector('meta[name="pagedserve-base"]').content;
  const POLL_MS = 1000;
  const HISTORY_S = 300;       // client-side history kept for the charts
  const CHART_WINDOW_S = 120;  // what the charts show
  const STATE_NAMES = { f: "free", u: "in use", c: "cached (free)", s: "shared", w: "being swapped", t: "transferred in",
                        a: "LoRA adapter pages" };
  const COLORS = ["#2f6fdb", "#e0445a", "#2a9d63", "#f2a516", "#7b3fd1", "#1aa3b8", "#8a5a2b", "#d14fa0"];
  const TIERS = ["device", "host"];

  const query = new URLSearchParams(location.search);
  const stateUrl = BASE + "/state" + (query.get("max_cells") ? "?max_cells=" + encodeURIComponent(query.get("max_cells")) : "");

  const history = [];          // {t, workers: {id: {usage, fill, hit, preempt, out, in}}}
  const views = {};            // worker id -> {root, tiers: {tier: view}}
  const colorOf = {};          // worker id -> colour
  let latest = null;
  let numUpdates = 0;
  let lastOk = 0;

  const $ = (sel) => document.querySelector(sel);
  const el = (tag, props, text) => {
    const node = document.createElement(tag);
    if (props) for (const [k, v] of Object.entries(props)) {
      if (k === "class") node.className = v; else if (k === "data") Object.assign(node.dataset, v); else node.setAttribute(k, v);
    }
    if (text !== undefined) node.textContent = text;
    return node;
  };
  const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
  const num = (x, digits) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits || 0));
  const ms = (s) => (s === null || s === undefined ? "–" : (1000 * s).toFixed(s < 0.01 ? 2 : 1) + " ms");

  // ---- polling --------------------------------------------------------------------------------
  async function poll() {
    let delay = POLL_MS;
    if (!document.hidden) {
      try {
        const response = await fetch(stateUrl, { cache: "no-store", credentials: "same-origin" });
        if (response.status === 401) {
          setStatus("not authorised: reload the page to sign in", "error");
        } else if (!response.ok) {
          setStatus("state request failed: HTTP " + response.status, "error");
        } else {
          const state = await response.json();
          render(state);
          lastOk = Date.now();
          delay = Math.max(POLL_MS, 1000 * (state.refresh_s || 0));  // large pools refresh more slowly
        }
      } catch (err) {
        setStatus("server unreachable (" + err.message + ")", "error");
      }
    }
    setTimeout(poll, delay);
  }

  function setStatus(text, kind) {
    const node = $("#status");
    node.textContent = text;
    node.className = "status " + (kind || "");
  }

  setInterval(() => {
    const refreshMs = Math.max(POLL_MS, 1000 * ((latest && latest.refresh_s) || 0));
    if (lastOk && Date.now() - lastOk > 3 * refreshMs) setStatus("stale: last update " + Math.round((Date.now() - lastOk) / 1000) + " s ago", "stale");
  }, 1000);

  // ---- rendering ------------------------------------------------------------------------------
  function render(state) {
    latest = state;
    numUpdates += 1;
    $("#model").textContent = state.model;
    const when = new Date(state.time * 1000).toLocaleTimeString();
    setStatus("live · updated " + when + " · " + Object.keys(state.workers).length + " workers");
    const ids = Object.keys(state.workers).sort();
    ids.forEach((id) => { if (!(id in colorOf)) colorOf[id] = COLORS[Object.keys(colorOf).length % COLORS.length]; });
    record(state, ids);
    renderMaps(state, ids);
    renderCharts(ids);
    renderCache(state, ids);
    renderQueues(state, ids);
    renderPreemptions(state, ids);
    renderLatency(state.latency || {});
    renderDecisions(state);
    $("#errors").textContent = (state.errors || []).join("\n");
    document.body.dataset.updates = String(numUpdates);
    document.body.dataset.stateTime = String(state.time);
  }

  function counterSample(state, id) {
    const pool = state.workers[id].pool || {};
    return {
      usage: pool.num_device_blocks ? (pool.device_blocks_used || 0) / pool.num_device_blocks : 0,
      fill: pool.kv_utilization || 0,
      hit: pool.prefix_cache_hit_rate || 0,
      preempt: (pool.num_preemptions_swap || 0) + (pool.num_preemptions_recompute || 0) + (pool.num_preemptions_migrate || 0),
      out: pool.num_blocks_swapped_out || 0,
      in: pool.num_blocks_swapped_in || 0,
    };
  }

  function record(state, ids) {
    const last = history[history.length - 1];
    if (last && last.t >= state.time) return;  // the same cached snapshot again
    const sample = { t: state.time, workers: {} };
    for (const id of ids) sample.workers[id] = counterSample(state, id);
    history.push(sample);
    while (history.length && history[0].t < state.time - HISTORY_S) history.shift();
  }

  // Per-second rate of a counter between the newest sample and one about a second before it.
  function rate(id, key, atIndex) {
    const i = atIndex === undefined ? history.length - 1 : atIndex;
    if (i < 1) return 0;
    const cur = history[i];
    let j = i - 1;
    while (j > 0 && cur.t - history[j].t < 0.9) j -= 1;
    const prev = history[j];
    if (!cur.workers[id] || !prev.workers[id] || cur.t <= prev.t) return 0;
    return Math.max(0, cur.workers[id][key] - prev.workers[id][key]) / (cur.t - prev.t);
  }

  // ---- block maps -----------------------------------------------------------------------------
  function renderMaps(state, ids) {
    const container = $("#maps");
    for (const id of Object.keys(views)) {
      if (!(id in state.workers)) { views[id].root.remove(); delete views[id]; }
    }
    for (const id of ids) {
      const worker = state.workers[id];
      let view = views[id];
      if (!view) {
        const root = el("div", { class: "worker", data: { worker: id } });
        const title = el("h3");
        root.append(title);
        view = views[id] = { root, title, tiers: {} };
        container.append(root);
      }
      view.root.classList.toggle("unhealthy", !worker.is_healthy);
      view.title.textContent = id + " · " + worker.role + rankSummary(worker.engine)
        + (worker.is_healthy ? "" : " · not answering");
      view.title.title = rankDetails(worker.engine);
      for (const tier of TIERS) renderTier(view, id, tier, (worker.tiers || {})[tier]);
    }
  }

  // A worker of several ranks (tensor parallelism): one pool per rank, same block ids, a share of the heads each.
  function rankSummary(engine) {
    const ranks = (engine && engine.ranks) || [];
    if (ranks.length < 2) return "";
    const mib = (ranks[0].device_pool_bytes || 0) / 1048576;
    return " · " + ranks.length + " ranks × " + (ranks[0].num_kv_heads || "?") + " KV heads, "
      + mib.toFixed(1) + " MiB pool each · " + (engine.kv_capacity_tokens || "?") + " tokens";
  }

  function rankDetails(engine) {
    return ((engine && engine.ranks) || []).map((r) => "rank " + r.rank + ": " + r.device + " on " + r.host
      + " (pid " + r.pid + "), " + r.num_device_blocks + " device blocks, " + r.num_host_blocks + " host blocks")
      .join("\n");
  }

  function renderTier(view, id, tier, data) {
    let tv = view.tiers[tier];
    if (!tv) {
      const box = el("div", { class: "tier" });
      const heading = el("h4");
      const grid = el("div", { class: "grid", data: { worker: id, tier } });
      grid.addEventListener("mousemove", (ev) => showTooltip(ev, id, tier));
      grid.addEventListener("mouseleave", hideTooltip);
      box.append(heading, grid);
      view.root.append(box);
      tv = view.tiers[tier] = { heading, grid, cells: [], mode: "", key: "" };
    }
    if (!data || !data.num_blocks) {
      tv.heading.textContent = tier + " · no blocks";
      rebuild(tv, "none", 0);
      return;
    }
    const counts = data.counts || {};
    const countText = Object.keys(STATE_NAMES).filter((k) => counts[k]).map((k) => STATE_NAMES[k] + " " + counts[k]).join(" · ");
    const per = data.blocks_per_cell;
    tv.heading.textContent = tier + " · " + data.num_blocks + " blocks of " + data.block_size + " tokens" +
      (per ? " · density map, " + per + " blocks per cell" : "") + (countText ? " · " + countText : "");
    tv.grid.dataset.numBlocks = String(data.num_blocks);
    if (data.states !== undefined) {
      rebuild(tv, "blocks", data.states.length);
      const states = data.states;
      for (let i = 0; i < states.length; i++) {
        const cls = "cell s-" + states[i];
        if (tv.cells[i].className !== cls) tv.cells[i].className = cls;
      }
    } else {
      const density = data.density || [];
      rebuild(tv, "density", density.length);
      for (let i = 0; i < density.length; i++) {
        const d = density[i];
        tv.cells[i].style.background = d > 0 ? "rgba(47, 111, 219, " + (0.15 + 0.85 * d).toFixed(3) + ")" : "";
        tv.cells[i].dataset.density = String(d);
      }
    }
    tv.data = data;
  }

  function rebuild(tv, mode, n) {
    const key = mode + ":" + n;
    if (tv.key === key) return;
    tv.key = key;
    tv.mode = mode;
    tv.grid.dataset.mode = mode;
    tv.grid.classList.toggle("small", n > 2048);
    const fragment = document.createDocumentFragment();
    tv.cells = [];
    for (let i = 0; i < n; i++) {
      const cell = el("i", { class: "cell s-f", data: { i: String(i) } });
      tv.cells.push(cell);
      fragment.append(cell);
    }
    tv.grid.replaceChildren(fragment);
    if (mode === "none") tv.grid.append(el("span", { class: "empty" }, "no pool"));
  }

  // ---- tooltip --------------------------------------------------------------------------------
  function showTooltip(ev, id, tier) {
    const cell = ev.target.closest(".cell");
    const tv = views[id] && views[id].tiers[tier];
    if (!cell || !tv || !tv.data) return hideTooltip();
    const i = Number(cell.dataset.i);
    const data = tv.data;
    const lines = [];
    if (tv.mode === "blocks") {
      const st = data.states[i];
      lines.push(id + " " + tier + " block " + i + ": " + STATE_NAMES[st]);
      const refs = (data.ref_counts || {})[i];
      if (refs) lines.push("ref count " + refs);
      const owners = (data.owners || {})[i];
      if (owners && owners.length) lines.push("owners: " + owners.join(", "));
      const hash = (data.hashes || {})[i];
      if (hash) lines.push("hash " + hash);
    } else {
      const per = data.blocks_per_cell;
      const first = i * per;
      const lastBlock = Math.min(data.num_blocks, first + per) - 1;
      lines.push(id + " " + tier + " blocks " + first + "–" + lastBlock);
      lines.push(pct(data.density[i]) + " in use");
    }
    const tip = $("#tooltip");
    tip.textContent = lines.join("\n");
    tip.hidden = false;
    const x = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    const y = Math.min(ev.clientY + 14, window.innerHeight - tip.offsetHeight - 8);
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }

  function hideTooltip() { $("#tooltip").hidden = true; }

  // ---- charts ---------------------------------------------------------------------------------
  function renderCharts(ids) {
    const now = history.length ? history[history.length - 1].t : 0;
    const utilSeries = ids.map((id) => ({
      label: id, color: colorOf[id],
      points: history.filter((s) => s.workers[id]).map((s) => [s.t, s.workers[id].usage]),
    }));
    drawChart($("#util-chart"), utilSeries, now, { yMax: 1, format: (v) => Math.round(100 * v) + "%" });
    const newest = history[history.length - 1];
    legend($("#util-legend"), ids.map((id) => {
      const w = (newest && newest.workers[id]) || { usage: 0, fill: 0 };
      return { label: id + " " + pct(w.usage), color: colorOf[id] };
    }));

    const hitSeries = ids.map((id) => ({
      label: id, color: colorOf[id],
      points: history.filter((s) => s.workers[id]).map((s) => [s.t, s.workers[id].hit]),
    }));
    drawChart($("#hit-chart"), hitSeries, now, { yMax: 1, format: (v) => Math.round(100 * v) + "%" });
    legend($("#hit-legend"), hitSeries.map((s) => ({ label: s.label + " " + pct(s.points.length ? s.points[s.points.length - 1][1] : 0), color: s.color })));

    const sum = (key, i) => ids.reduce((acc, id) => acc + rate(id, key, i), 0);
    const rateSeries = [
      { label: "preemptions/s", color: "#e0445a", points: history.map((s, i) => [s.t, sum("preempt", i)]) },
      { label: "blocks swapped out/s", color: "#f2a516", points: history.map((s, i) => [s.t, sum("out", i)]) },
      { label: "blocks swapped in/s", color: "#2a9d63", points: history.map((s, i) => [s.t, sum("in", i)]) },
    ];
    drawChart($("#rate-chart"), rateSeries, now, { format: (v) => String(Number(v.toPrecision(2))) });
    legend($("#rate-legend"), rateSeries.map((s) => ({ label: s.label + " " + num(s.points.length ? s.points[s.points.length - 1][1] : 0, 1), color: s.color })));
  }

  function legend(node, items) {
    node.replaceChildren(...items.map((it) => {
      const span = el("span", null, it.label);
      span.style.setProperty("--swatch", it.color);

      return span;
    }));
  }

  function drawChart(canvas, series, now, opts) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 400;
    const height = canvas.clientHeight || 150;
    if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
    if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const left = 46, right = 8, top = 8, bottom = 18;
    const plotW = width - left - right, plotH = height - top - bottom;
    let yMax = opts.yMax;
    if (!yMax) {
      yMax = 1;
      for (const s of series) for (const [t, v] of s.points) if (t >= now - CHART_WINDOW_S) yMax = Math.max(yMax, v * 1.15);
    }
    const x = (t) => left + plotW * (1 - (now - t) / CHART_WINDOW_S);
    const y = (v) => top + plotH * (1 - v / yMax);
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillStyle = "#6b7280";
    ctx.strokeStyle = "#e3e6eb";
    ctx.lineWidth = 1;
    for (let k = 0; k <= 4; k++) {
      const v = (yMax * k) / 4;
      ctx.beginPath();
      ctx.moveTo(left, y(v) + 0.5);
      ctx.lineTo(width - right, y(v) + 0.5);
      ctx.stroke();
      ctx.textAlign = "right";
      ctx.fillText(opts.format(v), left - 4, y(v) + 3);
    }
    ctx.textAlign = "center";
    for (let s = 0; s <= CHART_WINDOW_S; s += 30) ctx.fillText(s === 0 ? "now" : "-" + s + " s", x(now - s), height - 4);
    ctx.save();
    ctx.beginPath();
    ctx.rect(left, top - 1, plotW, plotH + 2);
    ctx.clip();
    ctx.lineWidth = 1.6;
    for (const s of series) {
      ctx.strokeStyle = s.color;
      ctx.beginPath();
      s.points.forEach(([t, v], i) => (i ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
      ctx.stroke();
    }
    ctx.restore();
  }

  // ---- tables ---------------------------------------------------------------------------------
  // A table cell with its raw value in data-value and a stable name in data-metric (the tests read both).
  function td(text, metric, value) {
    const node = el("td", null, text);
    if (metric) {
      node.dataset.metric = metric;
      if (value !== undefined && value !== null) node.dataset.value = String(value);
    }
    return node;
  }

  function fillTable(selector, rows) {
    $(selector + " tbody").replaceChildren(...rows.map((cells) => {
      const tr = el("tr");
      tr.append(...cells);
      return tr;
    }));
  }

  function renderCache(state, ids) {
    fillTable("#cache-table", ids.map((id) => {
      const pool = state.workers[id].pool || {};
      const usage = pool.num_device_blocks ? (pool.device_blocks_used || 0) / pool.num_device_blocks : null;
      return [
        td(id),
        td(num(pool.device_blocks_used) + " / " + num(pool.num_device_blocks), id + ".device_blocks_used", pool.device_blocks_used),
        td(pct(usage), id + ".kv_block_usage", usage),
        td(pct(pool.kv_utilization), id + ".kv_utilization", pool.kv_utilization),
        td(pct(pool.prefix_cache_hit_rate), id + ".prefix_cache_hit_rate", pool.prefix_cache_hit_rate),
        td(num(pool.num_prefix_hit_tokens) + " / " + num(pool.num_prefix_query_tokens), id + ".prefix_hit_tokens", pool.num_prefix_hit_tokens),
        td(num(pool.device_blocks_cached), id + ".device_blocks_cached", pool.device_blocks_cached),
        td(num(pool.device_blocks_adapter_pages), id + ".device_blocks_adapter_pages", pool.device_blocks_adapter_pages),
      ];
    }));
  }

  function renderQueues(state, ids) {
    const loads = (state.router && state.router.loads) || {};
    fillTable("#queue-table", ids.map((id) => {
      const worker = state.workers[id];
      const engine = worker.engine || {};
      const pool = worker.pool || {};
      const load = loads[id] || {};
      return [
        td(id),
        td(num(engine.num_waiting), id + ".num_waiting", engine.num_waiting),
        td(num(engine.num_running), id + ".num_running", engine.num_running),
        td(num(pool.num_swapped), id + ".num_swapped", pool.num_swapped),
        td(num(load.num_in_flight), id + ".num_in_flight", load.num_in_flight),
        td(worker.is_healthy ? "yes" : "no", id + ".is_healthy", worker.is_healthy ? 1 : 0),
        td(engine.spec_decode_num_drafts ? num(engine.spec_decode_mean_acceptance_length, 2) : "-",
           id + ".spec_decode_mean_acceptance_length", engine.spec_decode_mean_acceptance_length),
        td(draftKV(engine), id + ".spec_decode_draft_kv_bytes_per_block", engine.spec_decode_draft_kv_bytes_per_block),
        td(loraSlots(engine.lora)),
      ];
    }));
  }

  function draftKV(engine) {
    if (!engine.spec_decode_draft_model) return "-";
    const name = engine.spec_decode_draft_model.split("/").filter(Boolean).pop();
    return name + ": " + num(engine.spec_decode_draft_kv_bytes_per_block) + " B/block, " +
      num(engine.spec_decode_draft_scratch_blocks) + " scratch";
  }

  function loraSlots(lora) {
    if (!lora) return "-";
    const inSlots = lora.slot_adapters.filter((name) => name !== null);
    return (inSlots.join(", ") || "none") + " (" + inSlots.length + "/" + lora.max_loras + ") / " +
      lora.num_host_adapters + "/" + lora.max_cpu_loras;
  }

  function renderPreemptions(state, ids) {
    fillTable("#preempt-table", ids.map((id) => {
      const pool = state.workers[id].pool || {};
      return [
        td(id),
        td(num(rate(id, "preempt"), 2), id + ".preemptions_per_s", rate(id, "preempt")),
        td(num(rate(id, "out"), 1), id + ".swap_out_per_s", rate(id, "out")),
        td(num(rate(id, "in"), 1), id + ".swap_in_per_s", rate(id, "in")),
        td(num(pool.num_preemptions_swap) + " / " + num(pool.num_preemptions_recompute) + " / " + num(pool.num_preemptions_migrate),
           id + ".num_preemptions", counterSample(state, id).preempt),
      ];
    }));
  }

  function renderLatency(latency) {
    const names = { ttft: "time to first token", tpot: "time per output token", e2e: "end to end" };
    const rows = Object.keys(names).filter((k) => latency[k]).map((k) => {
      const l = latency[k];
      return [td(names[k]), td(ms(l.p50), "latency." + k + ".p50", l.p50), td(ms(l.p90), "latency." + k + ".p90", l.p90),
              td(ms(l.p99), "latency." + k + ".p99", l.p99), td(ms(l.mean), "latency." + k + ".mean", l.mean),
              td(num(l.count), "latency." + k + ".count", l.count)];
    });
    if (!rows.length) rows.push([td("not recorded by this server")]);
    fillTable("#latency-table", rows);
  }

  function renderDecisions(state) {
    const reasons = (state.router && state.router.reasons) || {};
    $("#reason-counts").textContent = Object.entries(reasons).map(([r, n]) => r + " " + n).join(" · ");
    const decisions = (state.decisions || []).slice().reverse();
    const rows = decisions.map((d) => {
      const reason = el("span", { class: "reason reason-" + d.reason }, d.reason);
      const reasonCell = el("td");
      reasonCell.append(reason);
      const scores = Object.entries(d.scores || {}).map(([w, s]) => w + ": " + Math.round(s)).join("  ");
      return [td(new Date(d.timestamp * 1000).toLocaleTimeString()), td(d.request_id), td(d.worker_id), reasonCell,
              td(d.cached_tokens + " / " + d.prompt_tokens), td(scores)];
    });
    if (!rows.length) rows.push([td("no requests routed yet")]);
    fillTable("#decision-table", rows);
  }

  window.pagedserveDashboard = { history, get state() { return latest; }, get numUpdates() { return numUpdates; } };
  poll();
})();
