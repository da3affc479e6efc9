//! A real Prometheus scrapes a running `switchyard serve` and `switchyard epp` (each its own job)
//! on 127.0.0.1 with the rules of deploy/prometheus/ loaded: what it stores is what the gateway
//! counted (names, labels, values), and every recording and alerting rule evaluates without error
//! on the real series (a label mismatch in a `group_left`, say, would show here and in no unit
//! test), as does every query of the Grafana dashboard.
//!
//! Prometheus is Debian's `prometheus` package (2.42 on bookworm; scripts/check-prometheus.sh
//! installs it): `$SWITCHYARD_PROMETHEUS`, else `prometheus` on the PATH. Without it the test
//! says so and passes, except when `SWITCHYARD_REQUIRE_PROMETHEUS` is set (scripts/test.sh, so
//! CI), where a missing Prometheus fails it.

mod gateway_support;
mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gateway_support::*;
use serde_json::Value;

fn prometheus_binary() -> Option<PathBuf> {
    let found = match std::env::var_os("SWITCHYARD_PROMETHEUS") {
        Some(p) => Some(PathBuf::from(p)).filter(|p| p.exists()),
        None => std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("prometheus"))
                .find(|p| p.is_file())
        }),
    };
    if found.is_none() {
        assert!(
            std::env::var_os("SWITCHYARD_REQUIRE_PROMETHEUS").is_none(),
            "Prometheus not found ($SWITCHYARD_PROMETHEUS or `prometheus` on the PATH; \
             scripts/check-prometheus.sh installs Debian's)"
        );
        eprintln!(
            "skipped: Prometheus not found ($SWITCHYARD_PROMETHEUS or `prometheus` on the PATH; \
             apt-get install prometheus, or run scripts/check-prometheus.sh as root)"
        );
    }
    found
}

/// A running Prometheus with its own temporary directory; killed and removed when dropped.
struct Prometheus {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    base: String,
    dir: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A port free a moment ago (Prometheus 2.42 cannot report an ephemeral one).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Starts Prometheus scraping each (job, `host:port`) of `targets` every second with
/// deploy/prometheus/'s rules; waits for its readiness endpoint. A port taken between the probe
/// and the bind gets another try.
async fn start_prometheus(bin: &Path, targets: &[(&str, String)]) -> Prometheus {
    let rules = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/prometheus");
    let c = client();
    for attempt in 0..3 {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!(
            "switchyard-prometheus-{}-{port}",
            std::process::id()
        ));
        std::fs::create_dir_all(dir.join("data")).unwrap();
        let mut config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {rules}/recording.yml\n  - {rules}/alerts.yml\n\
             scrape_configs:\n"
        );
        for (job, target) in targets {
            config += &format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: [\"{target}\"]\n"
            );
        }
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        let child = Command::new(bin)
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn prometheus");
        let mut p = Prometheus {
            child,
            base: format!("http://127.0.0.1:{port}"),
            dir,
        };
        // Ready, or exited (the port was taken), polled until the deadline.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = p.child.try_wait() {
                eprintln!("prometheus exited at start: {status} (attempt {attempt}, port {port})");
                break;
            }
            let ready = c.get(format!("{}/-/ready", p.base)).send().await;
            if ready.is_ok_and(|r| r.status().is_success()) {
                return p;
            }
            assert!(
                Instant::now() < deadline,
                "Prometheus not ready within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    panic!("Prometheus did not start");
}

/// The result vector of an instant query (None on any error, so callers can poll).
async fn query(c: &reqwest::Client, prom: &Prometheus, promql: &str) -> Option<Vec<Value>> {
    let url = format!("{}/api/v1/query?query={}", prom.base, encode(promql));
    let v: Value = c.get(url).send().await.ok()?.json().await.ok()?;
    if v["status"] != "success" {
        return None;
    }
    v["data"]["result"].as_array().cloned()
}

/// label value -> sample value of a query's result, by `label`.
fn by_label(result: &[Value], label: &str) -> BTreeMap<String, f64> {
    result
        .iter()
        .filter_map(|s| {
            let key = s["metric"][label].as_str()?.to_string();
            let value = s["value"][1].as_str()?.parse().ok()?;
            Some((key, value))
        })
        .collect()
}

/// The gateway's own count of `ok` requests per backend, from its /metrics.
fn ok_per_backend(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter_map(|l| l.strip_prefix("switchyard_requests_total{backend=\""))
        .filter_map(|rest| {
            let (backend, rest) = rest.split_once('"')?;
            let value = rest
                .strip_prefix(",outcome=\"ok\"} ")?
                .trim()
                .parse()
                .ok()?;
            (!backend.is_empty()).then(|| (backend.to_string(), value))
        })
        .collect()
}

#[tokio::test]
async fn prometheus_scrapes_the_gateway_and_evaluates_every_rule() {
    let Some(bin) = prometheus_binary() else {
        return;
    };
    let (e1, e2) = (engine(&[]), engine(&[]));
    let gw = gateway(&[
        "--backend",
        &backend(&e1),
        "--backend",
        &backend(&e2),
        "--policy",
        "round-robin",
    ]);
    // The endpoint picker over the same engines, scraped as its own job on its metrics port.
    let picker = epp(&["--backend", &backend(&e1), "--backend", &backend(&e2)]);
    let targets = [
        ("switchyard-serve", gw.authority()),
        ("switchyard-epp", picker.authority()),
    ];
    let prom = start_prometheus(&bin, &targets).await;
    let c = client();

    // A first scrape of both before any request, so the counters rise between scrapes (rates
    // above 0), and each job sees both engines healthy under its own name.
    let healthy = poll(Duration::from_secs(30), || async {
        let up = query(&c, &prom, "up == 1").await?;
        let q = "count by (job) (switchyard_backend_healthy == 1)";
        let per_job = by_label(&query(&c, &prom, q).await?, "job");
        (up.len() == 2 && per_job.values().all(|&n| n == 2.0) && per_job.len() == 2)
            .then_some(per_job)
    })
    .await;
    assert!(
        healthy.is_some(),
        "Prometheus never saw both jobs up with both engines healthy"
    );

    let n = 6;
    for i in 0..n {
        let r = post(
            &c,
            &gw.url("/v1/chat/completions"),
            &chat(&format!("q {i}"), 2),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text);
    }
    let own = ok_per_backend(&get_with(&c, &gw.url("/metrics"), &[]).await.text);
    assert_eq!(own.len(), 2, "both backends served (round robin): {own:?}");
    assert_eq!(own.values().sum::<f64>(), n as f64, "{own:?}");

    // Prometheus stores the same series, names and labels as the gateway counted them.
    let q =
        "sum by (backend) (switchyard_requests_total{job=\"switchyard-serve\", outcome=\"ok\"})";
    let stored = poll(Duration::from_secs(30), || async {
        let seen = by_label(&query(&c, &prom, q).await?, "backend");
        (seen == own).then_some(seen)
    })
    .await;
    assert!(stored.is_some(), "Prometheus never held {own:?} for {q}");

    // A recording rule's output: each backend's request rate, above 0, with job and backend.
    let rates = poll(Duration::from_secs(30), || async {
        let r = query(&c, &prom, "job_backend:switchyard_requests:rate1m > 0").await?;
        let seen = by_label(&r, "backend");
        let jobs_ok = r.iter().all(|s| s["metric"]["job"] == "switchyard-serve");
        (jobs_ok && seen.keys().eq(own.keys())).then_some(seen)
    })
    .await;
    assert!(
        rates.is_some(),
        "job_backend:switchyard_requests:rate1m never covered {:?}",
        own.keys()
    );
    // The hot-spot chain (histogram quantiles, their median, the ratio): the worst backend is at
    // least the median, so the ratio is a finite number of at least 1.
    let hot = poll(Duration::from_secs(30), || async {
        let q = "job:switchyard_ttft_hot_spot:max_ratio_5m{job=\"switchyard-serve\"}";
        let r = query(&c, &prom, q).await?;
        let v: f64 = r.first()?["value"][1].as_str()?.parse().ok()?;
        (v.is_finite() && v >= 1.0).then_some(v)
    })
    .await;
    assert!(hot.is_some(), "no hot-spot ratio recorded");

    // Every query of the Grafana dashboard, its variables filled in, runs without error here.
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/grafana/switchyard.json"
    );
    let board: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let (mut answered, mut total) = (0, 0);
    for panel in board["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$__rate_interval", "1m")
                .replace("$job", ".*")
                .replace("$backend", ".*");
            let result = query(&c, &prom, &expr).await;
            let title = &panel["title"];
            let result = result.unwrap_or_else(|| panic!("panel {title}: {expr} failed"));
            answered += usize::from(!result.is_empty());
            total += 1;
        }
    }
    eprintln!("dashboard: {answered} of {total} queries had data");
    assert!(
        answered > 10,
        "only {answered} of {total} dashboard queries had data"
    );

    // Every rule of both files loaded and evaluated without error on these real series.
    let expected_rules = ["recording.yml", "alerts.yml"]
        .iter()
        .map(|f| {
            let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/prometheus/");
            let text = std::fs::read_to_string(format!("{path}{f}")).unwrap();
            text.lines()
                .map(str::trim_start)
                .filter(|l| l.starts_with("- record:") || l.starts_with("- alert:"))
                .count()
        })
        .sum::<usize>();
    let last = std::cell::RefCell::new(Vec::new());
    let healthy = poll(Duration::from_secs(30), || async {
        let v: Value = c
            .get(format!("{}/api/v1/rules", prom.base))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        let rules: Vec<Value> = v["data"]["groups"]
            .as_array()?
            .iter()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        let bad: Vec<String> = rules
            .iter()
            .filter(|r| r["health"] != "ok")
            .map(|r| format!("{} {} {}", r["name"], r["health"], r["lastError"]))
            .collect();
        let clean = bad.is_empty();
        *last.borrow_mut() = bad;
        (rules.len() == expected_rules && clean).then_some(())
    })
    .await;
    assert!(
        healthy.is_some(),
        "not every one of the {expected_rules} rules evaluated cleanly: {:?}",
        last.borrow()
    );
}
