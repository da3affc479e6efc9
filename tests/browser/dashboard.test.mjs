// The dashboard in a real browser: Debian's chromium, headless, driven by playwright-core,
// against `switchyard demo` (three emulated engines and the gateway, on 127.0.0.1 ephemeral
// ports). Run by scripts/browser-test.sh (which installs chromium and the pinned
// playwright-core first):
//
//   SWITCHYARD_BIN=target/debug/switchyard node --test tests/browser/
//
// DASHBOARD_SCREENSHOT=path also saves a screenshot of the page under load there.
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { chromium } from "playwright-core";

const BIN = process.env.SWITCHYARD_BIN || "target/debug/switchyard";
const CHROMIUM = process.env.CHROMIUM || "/usr/bin/chromium";
const MODEL = "demo-llama-8b";
// Flags that work in a container without a display or a GPU, and keep the browser from
// calling out to anything (no updates, no sync, no QUIC probes).
const FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync"];

/** Polls `f` until it returns a truthy value or `ms` pass (then fails with `what`). */
async function until(what, ms, f) {
  const deadline = Date.now() + ms;
  for (;;) {
    const v = await f();
    if (v) return v;
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms: ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

/** Starts `switchyard demo` on an ephemeral port; resolves with its URL once it listens. */
function startDemo(token) {
  const child = spawn(BIN, ["demo", "--listen", "127.0.0.1:0", "--admin-token", token],
    { stdio: ["ignore", "pipe", "pipe"] });
  let out = "";
  child.stderr.on("data", (d) => { out += d; });
  const url = new Promise((resolve, reject) => {
    child.stdout.on("data", (d) => {
      out += d;
      const m = out.match(/listening on (http:\/\/[0-9.:]+)/);
      if (m) resolve(m[1]);
    });
    child.on("exit", (code) => reject(new Error(`demo exited (${code}) before listening:\n${out}`)));
  });
  return { child, url, output: () => out };
}

/** Sends streamed chat requests from `workers` loops until `stop.done`; counts answers. */
function load(url, workers, stop) {
  const counts = { ok: 0, failed: 0 };
  const loop = async (w) => {
    for (let k = 0; !stop.done; k++) {
      // Some shared prefixes (cache hits), some adapter requests, varied lengths.
      const model = k % 5 === 4 ? "sql-lora" : MODEL;
      const content = `group ${k % 3} `.repeat(40) + `worker ${w} request ${k}`;
      try {
        const r = await fetch(`${url}/v1/chat/completions`, {
          method: "POST",
          headers: { "content-type": "application/json" },
          body: JSON.stringify({ model, messages: [{ role: "user", content }],
            max_tokens: 16 + (k % 4) * 16, stream: true }),
        });
        await r.text();
        if (r.ok) counts.ok++; else counts.failed++;
      } catch {
        counts.failed++;
      }
    }
  };
  return { counts, done: Promise.all(Array.from({ length: workers }, (_, w) => loop(w))) };
}

test("the dashboard shows the fleet live, under load and with a drained instance", async (t) => {
  const token = randomBytes(12).toString("hex");
  const demo = startDemo(token);
  t.after(() => demo.child.kill("SIGKILL"));
  const url = await demo.url;
  const auth = { authorization: `Bearer ${token}` };

  // The gateway listens before it has asked every engine for its models (`pending_discovery`):
  // wait for all three to join.
  let fleet = null;
  const joined = await until("all three engines join the fleet", 10000, async () => {
    fleet = await (await fetch(`${url}/admin/fleet`, { headers: auth })).json();
    return fleet.backends.length === 3;
  }).catch(() => false);
  assert.ok(joined, JSON.stringify(fleet));
  const names = fleet.backends.map((b) => b.name).sort();
  assert.equal(names.length, 3, JSON.stringify(fleet));

  const browser = await chromium.launch({ executablePath: CHROMIUM, headless: true, args: FLAGS });
  t.after(() => browser.close());

  // Without credentials: 401 with a Basic challenge (a browser asks for the token), no figures.
  for (const path of ["/dashboard", "/dashboard/snapshot", "/dashboard/events"]) {
    const denied = await fetch(`${url}${path}`);
    assert.equal(denied.status, 401, path);
    assert.match(denied.headers.get("www-authenticate") || "", /^Basic /, path);
    assert.doesNotMatch(await denied.text(), /engine-/, path);
  }

  // A browser answers the challenge with Basic credentials, the token as password; the
  // page's event stream then carries them too.
  const context = await browser.newContext({
    httpCredentials: { username: "admin", password: token },
    viewport: { width: 1500, height: 1100 },
  });
  const page = await context.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  const response = await page.goto(`${url}/dashboard`);
  assert.equal(response.status(), 200);

  // Every instance has a row.
  await page.waitForFunction((n) => document.querySelectorAll("#instances tbody tr").length === n,
    names.length, { timeout: 10_000 });
  const rows = await page.$$eval("#instances tbody tr", (trs) => trs.map((tr) => tr.dataset.instance));
  assert.deepEqual(rows.sort(), names);
  const routedBefore = Number(await page.textContent("#c-routed"));

  // Under load the figures move: requests counted, traffic shares and TTFTs appear, the
  // decisions list fills.
  const stop = { done: false };
  const traffic = load(url, 6, stop);
  try {
    await page.waitForFunction((before) => {
      const routed = Number(document.getElementById("c-routed").textContent);
      const shares = [...document.querySelectorAll('#instances td[data-col="share"]')]
        .filter((td) => td.textContent.includes("%")).length;
      const ttft = [...document.querySelectorAll('#instances td[data-col="ttft_p50"]')]
        .filter((td) => td.textContent.trim() !== "–").length;
      const decisions = document.querySelectorAll("#decisions tbody tr").length;
      return routed > before + 10 && shares >= 2 && ttft >= 2 && decisions >= 10;
    }, routedBefore, { timeout: 20_000, polling: 200 });
    // And keep moving: the next updates show different numbers.
    const first = await page.textContent("#instances tbody");
    await until("the table to change under load", 10_000,
      async () => (await page.textContent("#instances tbody")) !== first);
    const explain = await page.textContent("#decisions tbody tr td.explain");
    assert.match(explain, /^policy=cost eligible=\d+/);
    if (process.env.DASHBOARD_SCREENSHOT) {
      // For the picture in the docs: half a minute of history in the charts first.
      await page.waitForFunction(() => Number(document.body.dataset.updates) >= 30,
        null, { timeout: 60_000, polling: 500 });
      await page.screenshot({ path: process.env.DASHBOARD_SCREENSHOT, fullPage: true });
    }

    // A drained instance shows as drained (the next event, within about a second).
    const drained = names[1];
    const r = await fetch(`${url}/admin/drain/${drained}`, { method: "POST", headers: auth });
    assert.equal(r.status, 200);
    const row = `#instances tr[data-instance="${drained}"]`;
    await page.waitForSelector(`${row}[data-state="drained"]`, { timeout: 5_000 });
    assert.equal((await page.textContent(`${row} td[data-col="state"]`)).trim(), "drained");
    for (const other of names.filter((n) => n !== drained)) {
      assert.equal(await page.getAttribute(`#instances tr[data-instance="${other}"]`, "data-state"),
        "healthy");
    }
  } finally {
    stop.done = true;
    await traffic.done;
  }
  assert.ok(traffic.counts.ok > 20, JSON.stringify(traffic.counts));
  assert.deepEqual(errors, []);

  // Shutdown does not wait for the open event stream: SIGTERM ends the demo well within the
  // gateway's drain timeout (30 s) while the page is still connected.
  const started = Date.now();
  const exited = new Promise((resolve) => demo.child.on("exit", (code) => resolve(code)));
  demo.child.kill("SIGTERM");
  let timer;
  const hung = new Promise((r) => { timer = setTimeout(() => r("hung"), 10_000); });
  const code = await Promise.race([exited, hung]);
  clearTimeout(timer);
  assert.equal(code, 0, `demo exit after SIGTERM: ${code}\n${demo.output()}`);
  assert.ok(Date.now() - started < 10_000);
  await until("the page to notice the end of the stream", 5_000,
    async () => (await page.textContent("#status")) !== null &&
      !(await page.textContent("#status")).startsWith("live"));
});
