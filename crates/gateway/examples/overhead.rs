//! Open-loop load generator for the gateway overhead benchmark (`bench/overhead.sh`).
//!
//! Sends chat requests to `URL/v1/chat/completions` at a constant rate on a fixed schedule
//! (request `i` is due at `start + i / rate`, whatever happened to the earlier ones: open
//! loop, so a slow server cannot slow the offered load down) for `--warmup` + `--duration`
//! seconds, and records with HDR histograms the latency of each request measured in the
//! warm-up-free window, to the *complete* response body:
//!
//! - from the request's scheduled time (the open-loop figure: includes any wait for a free
//!   connection slot and any lateness of the generator, so queueing is never hidden), and
//! - from the moment the request was handed to the HTTP client (service time),
//!
//! plus how late the generator itself sent requests (its own health check). Run it against an
//! `--instant` engine directly and through a proxy: the difference is the proxy's added latency.
//!
//! The schedule is kept by a `timerfd` (microsecond wake-ups; tokio's own timer has a 1 ms
//! granularity, which would send requests in bursts) on a single-threaded runtime, or with
//! `--spin` by busy-polling (for a generator pinned to a core of its own: no wake-up from idle
//! delays a send or the reading of a response, which on a VM costs tens of µs). Loopback
//! only; everything is bounded: at most `--max-in-flight` requests outstanding, and requests not
//! finished `--drain` seconds after the last one was due are counted as timed out.
//!
//! ```text
//! cargo run --release -p switchyard-gateway --example overhead -- \
//!     --url http://127.0.0.1:8080 --rate 2000 --duration 10 --warmup 2 [--label NAME] \
//!     [--model M] [--words 2048] [--max-tokens 4] [--stream] [--unique] [--max-in-flight 256] \
//!     [--spin]
//! ```
//!
//! The request is a chat request whose user message is `--words` four-byte words (three letters
//! and a space: 2048 words are 8 KiB, 2,048 tokens for the emulator's 4-bytes-per-token
//! tokenizer), non-streaming unless `--stream`. `--unique` puts a per-request number first, so
//! no two prompts share a prefix. The last line is machine-readable:
//! `RESULT label=... rate=... achieved=... p50_us=... p99_us=... p999_us=...`.

use std::cell::RefCell;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{Notify, Semaphore};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

const USAGE: &str = "usage: overhead --url URL [--rate R] [--duration S] [--warmup S] [--label L] \
[--model M] [--words N] [--max-tokens N] [--stream] [--unique] [--max-in-flight N] [--drain S] \
[--spin] [--deciles]";

struct Opts {
    url: String,
    rate: f64,
    duration: f64,
    warmup: f64,
    label: String,
    model: String,
    words: usize,
    max_tokens: u32,
    stream: bool,
    unique: bool,
    max_in_flight: usize,
    drain: f64,
    spin: bool,
    deciles: bool,
}

fn opts() -> Result<Opts, String> {
    let mut o = Opts {
        url: String::new(),
        rate: 2000.0,
        duration: 10.0,
        warmup: 2.0,
        label: String::new(),
        model: "m".into(),
        words: 2048,
        max_tokens: 4,
        stream: false,
        unique: false,
        max_in_flight: 256,
        drain: 5.0,
        spin: false,
        deciles: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        let num = |s: String| s.parse::<f64>().map_err(|e| format!("{s}: {e}"));
        match a.as_str() {
            "--url" => o.url = value(&a)?,
            "--rate" => o.rate = num(value(&a)?)?,
            "--duration" => o.duration = num(value(&a)?)?,
            "--warmup" => o.warmup = num(value(&a)?)?,
            "--label" => o.label = value(&a)?,
            "--model" => o.model = value(&a)?,
            "--words" => o.words = num(value(&a)?)? as usize,
            "--max-tokens" => o.max_tokens = num(value(&a)?)? as u32,
            "--max-in-flight" => o.max_in_flight = (num(value(&a)?)? as usize).max(1),
            "--drain" => o.drain = num(value(&a)?)?,
            "--stream" => o.stream = true,
            "--unique" => o.unique = true,
            "--spin" => o.spin = true,
            "--deciles" => o.deciles = true,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    if o.url.is_empty() {
        return Err(USAGE.into());
    }
    if !(o.rate > 0.0 && o.duration > 0.0 && o.warmup >= 0.0 && o.drain >= 0.0) {
        return Err("--rate and --duration must be > 0, --warmup and --drain >= 0".into());
    }
    if o.rate * (o.duration + o.warmup) > 50_000_000.0 {
        return Err("more than 50 million requests: lower --rate or --duration".into());
    }
    if o.label.is_empty() {
        o.label = o.url.clone();
    }
    Ok(o)
}

/// CLOCK_MONOTONIC in nanoseconds (the clock `Instant` and timerfd use).
fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Precise absolute-time sleeps: a one-shot timerfd armed for each deadline, read through the
/// runtime's epoll.
struct Pacer {
    fd: AsyncFd<OwnedFd>,
    spin: bool,
    /// With `spin`: gaps over `STALL_NS` between two looks at the clock (the generator's core
    /// was taken away: host preemption on a VM, or an interrupt storm), count and total ns.
    stalls: std::cell::Cell<(u64, u64)>,
}

/// A gap in the spin loop longer than this is a stall of the generator's core.
const STALL_NS: u64 = 200_000;

impl Pacer {
    fn new(spin: bool) -> io::Result<Self> {
        // SAFETY: plain syscall; the result is checked before it is owned.
        let raw = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: the descriptor is owned by the `AsyncFd` and stays open as long as it.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }?;
        Ok(Pacer {
            fd,
            spin,
            stalls: std::cell::Cell::new((0, 0)),
        })
    }

    async fn sleep_until(&self, deadline_ns: u64) -> io::Result<()> {
        if now_ns() >= deadline_ns {
            return Ok(());
        }
        if self.spin {
            // Busy-poll: each yield lets the runtime poll its sockets (epoll with a zero
            // timeout), so neither the schedule nor the responses wait for a wake-up from idle.
            let mut last = now_ns();
            while last < deadline_ns {
                tokio::task::yield_now().await;
                let now = now_ns();
                if now - last > STALL_NS {
                    let (n, total) = self.stalls.get();
                    self.stalls.set((n + 1, total + (now - last)));
                }
                last = now;
            }
            return Ok(());
        }
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
                tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
            },
        };
        // SAFETY: valid descriptor and itimerspec; old value not requested.
        let rc = unsafe {
            libc::timerfd_settime(
                self.fd.as_raw_fd(),
                libc::TFD_TIMER_ABSTIME,
                &spec,
                std::ptr::null_mut(),
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        loop {
            let mut guard = self.fd.readable().await?;
            let read = guard.try_io(|fd| {
                let mut expirations = 0u64;
                // SAFETY: reads 8 bytes into a u64.
                let n =
                    unsafe { libc::read(fd.as_raw_fd(), (&mut expirations as *mut u64).cast(), 8) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(())
                }
            });
            match read {
                Ok(r) => return r,
                Err(_would_block) => continue,
            }
        }
    }
}

/// What the measured window recorded.
struct Stats {
    /// Scheduled time -> complete response (ns).
    from_schedule: Histogram<u64>,
    /// Handed to the client -> complete response (ns).
    from_send: Histogram<u64>,
    /// Handed to the client - scheduled time (ns): the generator's own lateness.
    lag: Histogram<u64>,
    ok: u64,
    errors: u64,
    first_error: Option<String>,
    last_done_ns: u64,
    outstanding: usize,
}

impl Stats {
    fn new() -> Self {
        let h = || Histogram::new_with_bounds(100, 120_000_000_000, 3).expect("histogram bounds");
        Stats {
            from_schedule: h(),
            from_send: h(),
            lag: h(),
            ok: 0,
            errors: 0,
            first_error: None,
            last_done_ns: 0,
            outstanding: 0,
        }
    }
}

/// Three-letter words plus a space: four bytes, one emulator token each.
const WORDS: [&str; 16] = [
    "the ", "and ", "for ", "you ", "are ", "was ", "but ", "not ", "all ", "can ", "had ", "her ",
    "one ", "our ", "out ", "day ",
];

fn prompt(words: usize) -> String {
    let mut s = String::with_capacity(words * 4);
    for i in 0..words {
        // A fixed, non-repeating-looking sequence (so it is not one block repeated).
        s.push_str(WORDS[(i * 7 + i / 16) % WORDS.len()]);
    }
    s
}

fn body(o: &Opts, text: &str, unique: Option<u64>) -> Bytes {
    let prefix = unique.map(|n| format!("{n:08} ")).unwrap_or_default();
    let stream = if o.stream { ",\"stream\":true" } else { "" };
    Bytes::from(format!(
        r#"{{"model":"{}","messages":[{{"role":"user","content":"{prefix}{text}"}}],"max_tokens":{}{stream}}}"#,
        o.model, o.max_tokens
    ))
}

fn request(uri: &hyper::Uri, body: Bytes) -> hyper::Request<Full<Bytes>> {
    hyper::Request::post(uri.clone())
        .header("content-type", "application/json")
        .body(Full::new(body))
        .expect("request")
}

/// One request, to the end of its body: Ok(body length) for a 2xx.
async fn exchange(client: &HttpClient, req: hyper::Request<Full<Bytes>>) -> Result<Bytes, String> {
    let response = client.request(req).await.map_err(|e| format!("{e:?}"))?;
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    if status.is_success() {
        Ok(bytes)
    } else {
        Err(format!(
            "status {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        ))
    }
}

/// CPU seconds (user + system) this process has used.
fn cpu_seconds() -> f64 {
    // SAFETY: an all-zero rusage is valid, and getrusage fills it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

fn main() {
    let o = match opts() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    // Precise wake-ups for the runtime's epoll timeouts too (the pacer does not depend on it).
    // SAFETY: plain prctl.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let local = tokio::task::LocalSet::new();
    let code = local.block_on(&runtime, run(o));
    std::process::exit(code);
}

async fn run(o: Opts) -> i32 {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(o.max_in_flight)
        .pool_idle_timeout(Duration::from_secs(120))
        .build(connector);
    let base = o.url.trim_end_matches('/');
    let uri: hyper::Uri = match format!("{base}/v1/chat/completions").parse() {
        Ok(u) => u,
        Err(e) => {
            eprintln!("bad url {base}: {e}");
            return 2;
        }
    };
    let text: Arc<str> = Arc::from(prompt(o.words));
    let fixed = body(&o, &text, None);

    // Preflight: one request must succeed; show what the answers look like.
    match exchange(&client, request(&uri, fixed.clone())).await {
        Ok(b) => {
            let usage = serde_json::from_slice::<serde_json::Value>(&b)
                .ok()
                .and_then(|v| v.get("usage").map(ToString::to_string))
                .unwrap_or_else(|| "(streamed)".into());
            eprintln!(
                "{}: request {} bytes, answer {} bytes, usage {usage}",
                o.label,
                fixed.len(),
                b.len()
            );
        }
        Err(e) => {
            eprintln!("{}: preflight request failed: {e}", o.label);
            return 1;
        }
    }

    let pacer = match Pacer::new(o.spin) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("timerfd: {e}");
            return 1;
        }
    };
    let stats = Rc::new(RefCell::new(Stats::new()));
    let idle = Rc::new(Notify::new());
    let slots = Rc::new(Semaphore::new(o.max_in_flight));
    let period = 1e9 / o.rate;
    let total = ((o.warmup + o.duration) * o.rate).round() as u64;
    let warm = (o.warmup * o.rate).round() as u64;
    let start = now_ns() + 20_000_000;
    let measure_from = start + (warm as f64 * period) as u64;
    let mut sent_measured = 0u64;
    for i in 0..total {
        let due = start + (i as f64 * period) as u64;
        if let Err(e) = pacer.sleep_until(due).await {
            eprintln!("timerfd: {e}");
            return 1;
        }
        let measured = i >= warm;
        sent_measured += u64::from(measured);
        let req = if o.unique {
            request(&uri, body(&o, &text, Some(i)))
        } else {
            request(&uri, fixed.clone())
        };
        let (client, stats, idle, slots) =
            (client.clone(), stats.clone(), idle.clone(), slots.clone());
        stats.borrow_mut().outstanding += 1;
        tokio::task::spawn_local(async move {
            let permit = slots.acquire().await.expect("semaphore open");
            let sent = now_ns();
            let result = exchange(&client, req).await;
            let done = now_ns();
            drop(permit);
            let mut s = stats.borrow_mut();
            s.outstanding -= 1;
            if measured {
                match result {
                    Ok(_) => {
                        s.ok += 1;
                        let _ = s.from_schedule.record(done.saturating_sub(due).max(100));
                        let _ = s.from_send.record(done.saturating_sub(sent).max(100));
                        let _ = s.lag.record(sent.saturating_sub(due).max(100));
                        s.last_done_ns = s.last_done_ns.max(done);
                    }
                    Err(e) => {
                        s.errors += 1;
                        s.first_error.get_or_insert(e);
                    }
                }
            }
            if s.outstanding == 0 {
                idle.notify_one();
            }
        });
    }
    let last_due = start + ((total.saturating_sub(1)) as f64 * period) as u64;
    let drain = Duration::from_secs_f64(o.drain);
    let wait_idle = async {
        while stats.borrow().outstanding > 0 {
            idle.notified().await;
        }
    };
    let drained = tokio::time::timeout(drain, wait_idle).await.is_ok();
    let s = stats.borrow();
    let timeouts = sent_measured - s.ok - s.errors;
    let window = (s.last_done_ns.max(last_due) - measure_from) as f64 / 1e9;
    let window = window.max(o.duration);
    let achieved = s.ok as f64 / window;
    let h = &s.from_schedule;
    if s.ok == 0 {
        eprintln!(
            "{}: no successful request ({} errors, first: {:?})",
            o.label, s.errors, s.first_error
        );
        println!(
            "RESULT label={} rate={} achieved=0 ok=0 errors={} timeouts={timeouts}",
            o.label, o.rate, s.errors
        );
        return 1;
    }
    println!(
        "{} @ {} req/s for {} s (+{} s warm-up): {} ok, {} errors, {} unfinished{}; achieved {:.0} req/s",
        o.label,
        o.rate,
        o.duration,
        o.warmup,
        s.ok,
        s.errors,
        timeouts,
        if drained { "" } else { " (drain timed out)" },
        achieved
    );
    if let Some(e) = &s.first_error {
        println!("  first error: {e}");
    }
    println!(
        "  from schedule (µs): p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}  mean {:.1}",
        us(h, 0.5),
        us(h, 0.9),
        us(h, 0.99),
        us(h, 0.999),
        h.max() as f64 / 1000.0,
        h.mean() / 1000.0
    );
    let f = &s.from_send;
    println!(
        "  from send     (µs): p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}  mean {:.1}",
        us(f, 0.5),
        us(f, 0.9),
        us(f, 0.99),
        us(f, 0.999),
        f.max() as f64 / 1000.0,
        f.mean() / 1000.0
    );
    if o.deciles {
        let qs: Vec<String> = (1..10)
            .map(|d| format!("p{}0 {:.0}", d, us(h, f64::from(d) / 10.0)))
            .collect();
        println!("  deciles from schedule (µs): {}", qs.join("  "));
    }
    println!(
        "  generator lateness (µs): p50 {:.1}  p99 {:.1}  max {:.1}",
        us(&s.lag, 0.5),
        us(&s.lag, 0.99),
        s.lag.max() as f64 / 1000.0
    );
    let (stalls, stalled_ns) = pacer.stalls.get();
    if o.spin {
        println!(
            "  generator core stalls over {} µs: {stalls}, {:.1} ms in all",
            STALL_NS / 1000,
            stalled_ns as f64 / 1e6
        );
    }
    println!(
        "RESULT label={} rate={} achieved={:.1} ok={} errors={} timeouts={} \
         p50_us={:.1} p90_us={:.1} p99_us={:.1} p999_us={:.1} max_us={:.1} mean_us={:.1} \
         send_p50_us={:.1} send_p99_us={:.1} send_p999_us={:.1} lag_p99_us={:.1} cpu_s={:.3} \
         stalls={stalls} stalled_ms={:.1}",
        o.label,
        o.rate,
        achieved,
        s.ok,
        s.errors,
        timeouts,
        us(h, 0.5),
        us(h, 0.9),
        us(h, 0.99),
        us(h, 0.999),
        h.max() as f64 / 1000.0,
        h.mean() / 1000.0,
        us(f, 0.5),
        us(f, 0.99),
        us(f, 0.999),
        us(&s.lag, 0.99),
        cpu_seconds(),
        stalled_ns as f64 / 1e6,
    );
    0
}
