//! Replicas found by DNS (`switchyard serve --peer-dns HOST:PORT`): a headless Service on
//! Kubernetes, a service name in Docker Compose, resolve to every replica's address.
//!
//! Every `interval` the name is resolved (`tokio::net::lookup_host`, the system resolver); each
//! address, of one family (IPv4 when the name has any, else IPv6: a dual-stack pod is one
//! replica, not two), is a peer at `http://ADDRESS:PORT`. This replica is left out: an address
//! on PORT that is its listen address, its `$POD_IP` (or one of `$POD_IPS`), or, when it
//! listens on every address (`0.0.0.0`, `::`), an address of this host (one a socket can bind
//! to, [`is_local_ip`]). The peers are `--peer`'s URLs plus those found, handed to replica sync
//! ([`crate::peer_sync::set_peers`], as the picker's pod watch does) whenever the found set
//! changes. A failed resolution keeps the last set; failing (warn) and recovering (info) are
//! logged once each, the failures in between at debug only: a warn line per interval would bury
//! everything else in an operator's logs for as long as the name is down.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use http::Uri;
use tokio::task::JoinHandle;

use crate::config::PeerDns;
use crate::state::Gateway;

/// Longest wait for one resolution (the system resolver may retry for longer).
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);

/// What marks a resolved address as this replica.
#[derive(Debug, Clone)]
pub struct SelfAddrs {
    /// The address the gateway listens on (its port the one a peer URL must have to be this).
    listen: SocketAddr,
    /// This pod's addresses (`$POD_IP`, `$POD_IPS`).
    pod_ips: Vec<IpAddr>,
}

impl SelfAddrs {
    /// This replica, listening on `listen`, with these pod addresses.
    pub fn new(listen: SocketAddr, pod_ips: Vec<IpAddr>) -> Self {
        SelfAddrs {
            listen,
            pod_ips: pod_ips.into_iter().map(canonical).collect(),
        }
    }

    /// This replica, listening on `listen`, with the pod addresses of `$POD_IP` and `$POD_IPS`
    /// (comma-separated; what is not an address is ignored).
    pub fn from_env(listen: SocketAddr) -> Self {
        let pod_ips = ["POD_IP", "POD_IPS"]
            .into_iter()
            .filter_map(|k| std::env::var(k).ok())
            .flat_map(|v| {
                v.split(',')
                    .filter_map(|ip| ip.trim().parse::<IpAddr>().ok())
                    .collect::<Vec<_>>()
            })
            .collect();
        SelfAddrs::new(listen, pod_ips)
    }

    /// Whether `addr` reaches this replica; `is_local` says whether an address is this host's
    /// (asked only when the gateway listens on every address).
    pub fn is_self(&self, addr: SocketAddr, is_local: impl Fn(IpAddr) -> bool) -> bool {
        if addr.port() != self.listen.port() {
            return false;
        }
        let ip = canonical(addr.ip());
        let listen = canonical(self.listen.ip());
        ip == listen
            || self.pod_ips.contains(&ip)
            || (listen.is_unspecified() && (ip.is_unspecified() || is_local(ip)))
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Whether `ip` is an address of this host: a socket can bind to it (no packet is sent), and
/// cannot bind to a documentation address of its family (where any address binds, Linux's
/// `ip_nonlocal_bind`, the probe tells nothing and says no).
pub fn is_local_ip(ip: IpAddr) -> bool {
    let binds = |ip: IpAddr| std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok();
    let documentation = match ip {
        IpAddr::V4(_) => IpAddr::from([192, 0, 2, 1]),
        IpAddr::V6(_) => IpAddr::from([0x2001, 0xdb8, 0, 0, 0, 0, 0, 1]),
    };
    binds(ip) && !binds(documentation)
}

/// The peer URLs (`http://ADDRESS:PORT`) of resolved addresses: IPv4 ones when there are any,
/// else IPv6 ones; this replica left out; each once, sorted.
pub fn peer_urls(
    resolved: &[SocketAddr],
    me: &SelfAddrs,
    is_local: impl Fn(IpAddr) -> bool,
) -> BTreeSet<String> {
    let any_v4 = resolved.iter().any(|a| canonical(a.ip()).is_ipv4());
    resolved
        .iter()
        .map(|a| SocketAddr::new(canonical(a.ip()), a.port()))
        .filter(|a| a.is_ipv4() == any_v4)
        .filter(|a| !me.is_self(*a, &is_local))
        .map(|a| format!("http://{a}"))
        .collect()
}

/// A change worth a log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// Resolution started failing (the error); the last set is kept.
    Failing(String),
    /// It works again after failing.
    Recovered,
}

/// What one resolution changes.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// The new found set, when it changed (to hand to replica sync).
    pub changed: Option<BTreeSet<String>>,
    /// Failing or recovering, once each.
    pub transition: Option<Transition>,
}

/// The found set and whether resolution is failing, across resolutions.
#[derive(Debug, Default)]
pub struct Follower {
    /// The set last handed to replica sync (none before the first success).
    applied: Option<BTreeSet<String>>,
    /// Whether the last resolution failed.
    failing: bool,
}

impl Follower {
    /// Takes one resolution's outcome: a failure keeps the last set; a success is applied when
    /// it differs from it.
    pub fn step(
        &mut self,
        resolved: Result<Vec<SocketAddr>, String>,
        me: &SelfAddrs,
        is_local: impl Fn(IpAddr) -> bool,
    ) -> Step {
        match resolved {
            Err(e) => Step {
                changed: None,
                transition: (!std::mem::replace(&mut self.failing, true))
                    .then_some(Transition::Failing(e)),
            },
            Ok(addrs) => {
                let transition =
                    std::mem::replace(&mut self.failing, false).then_some(Transition::Recovered);
                let urls = peer_urls(&addrs, me, is_local);
                let changed = (self.applied.as_ref() != Some(&urls)).then(|| {
                    self.applied = Some(urls.clone());
                    urls
                });
                Step {
                    changed,
                    transition,
                }
            }
        }
    }
}

/// Resolves `dns.host` on `dns.port`, within [`LOOKUP_TIMEOUT`].
async fn resolve(dns: &PeerDns) -> Result<Vec<SocketAddr>, String> {
    let lookup = tokio::net::lookup_host((dns.host.as_str(), dns.port));
    match tokio::time::timeout(LOOKUP_TIMEOUT, lookup).await {
        Ok(Ok(addrs)) => Ok(addrs.collect()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {LOOKUP_TIMEOUT:?}")),
    }
}

/// Starts following `--peer-dns` for a gateway listening on `listen` (none without the flag or
/// replica sync); the handle stops it, as does the gateway's shutdown.
pub fn spawn(gw: &Arc<Gateway>, listen: SocketAddr) -> Option<JoinHandle<()>> {
    let dns = gw.settings.peer_dns.clone()?;
    gw.peers.as_ref()?;
    let me = SelfAddrs::from_env(listen);
    Some(tokio::spawn(follow(gw.clone(), dns, me)))
}

/// Resolves every `dns.interval` until the gateway shuts down, handing changes to replica sync.
async fn follow(gw: Arc<Gateway>, dns: PeerDns, me: SelfAddrs) {
    let mut tick = tokio::time::interval(dns.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut follower = Follower::default();
    let name = format!("{}:{}", dns.host, dns.port);
    loop {
        tick.tick().await;
        if gw.is_shutting_down() {
            return;
        }
        let resolved = resolve(&dns).await;
        gw.metrics.peer_dns_lookup(resolved.is_ok());
        // Kept for the debug line: the step takes the result, and reports only the first failure.
        let error = resolved.as_ref().err().cloned();
        let step = follower.step(resolved, &me, is_local_ip);
        match (step.transition, error) {
            (Some(Transition::Failing(e)), _) => tracing::warn!(
                name = %name,
                "--peer-dns: resolution failing, keeping the last peers until it works again: {e}"
            ),
            (Some(Transition::Recovered), _) => {
                tracing::info!(name = %name, "--peer-dns: resolving again");
            }
            (None, Some(e)) => {
                tracing::debug!(name = %name, "--peer-dns: resolution still failing: {e}");
            }
            (None, None) => {}
        }
        if let Some(found) = step.changed {
            tracing::info!(name = %name, peers = ?found, "--peer-dns: peers changed");
            gw.metrics
                .peer_dns_peers
                .set(i64::try_from(found.len()).unwrap_or(i64::MAX));
            let urls: Vec<Uri> = found.iter().filter_map(|u| u.parse().ok()).collect();
            crate::peer_sync::set_peers(&gw, &urls);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn urls(set: &BTreeSet<String>) -> Vec<&str> {
        set.iter().map(String::as_str).collect()
    }

    /// A host whose addresses are 10.0.0.5, 127.0.0.1 and ::1.
    fn local(ip: IpAddr) -> bool {
        ["10.0.0.5", "127.0.0.1", "::1"]
            .iter()
            .any(|l| l.parse::<IpAddr>().unwrap() == ip)
    }

    #[test]
    fn a_specific_listen_address_is_left_out_on_its_port_only() {
        let me = SelfAddrs::new(addr("127.0.0.1:8080"), Vec::new());
        let resolved = [
            addr("127.0.0.1:8080"),
            addr("127.0.0.1:8081"),
            addr("10.0.0.5:8080"),
        ];
        // 10.0.0.5 is this host's but the gateway does not listen there: another process.
        assert_eq!(
            urls(&peer_urls(&resolved, &me, local)),
            ["http://10.0.0.5:8080", "http://127.0.0.1:8081"]
        );
    }

    #[test]
    fn the_pod_ip_is_left_out() {
        let me = SelfAddrs::new(addr("0.0.0.0:8080"), vec!["10.1.2.3".parse().unwrap()]);
        let resolved = [addr("10.1.2.3:8080"), addr("10.1.2.4:8080")];
        // Not a local address by the probe (say, a NAT), but $POD_IP says it is this pod.
        assert_eq!(
            urls(&peer_urls(&resolved, &me, |_| false)),
            ["http://10.1.2.4:8080"]
        );
        // The pod IP on another port is another process.
        let other_port = [addr("10.1.2.3:9090")];
        let me = SelfAddrs::new(addr("10.1.2.3:8080"), vec!["10.1.2.3".parse().unwrap()]);
        assert_eq!(
            urls(&peer_urls(&other_port, &me, |_| false)),
            ["http://10.1.2.3:9090"]
        );
    }

    #[test]
    fn listening_everywhere_leaves_out_every_local_address() {
        let me = SelfAddrs::new(addr("0.0.0.0:8080"), Vec::new());
        let resolved = [
            addr("10.0.0.5:8080"),
            addr("10.0.0.6:8080"),
            addr("127.0.0.1:8080"),
        ];
        assert_eq!(
            urls(&peer_urls(&resolved, &me, local)),
            ["http://10.0.0.6:8080"]
        );
        let me = SelfAddrs::new(addr("[::]:8080"), Vec::new());
        assert_eq!(
            urls(&peer_urls(&resolved, &me, local)),
            ["http://10.0.0.6:8080"]
        );
    }

    #[test]
    fn one_family_each_address_once() {
        let me = SelfAddrs::new(addr("127.0.0.1:1"), Vec::new());
        let dual = [
            addr("10.0.0.7:8080"),
            addr("[fd00::7]:8080"),
            addr("10.0.0.7:8080"),
            addr("[::ffff:10.0.0.8]:8080"),
        ];
        assert_eq!(
            urls(&peer_urls(&dual, &me, |_| false)),
            ["http://10.0.0.7:8080", "http://10.0.0.8:8080"]
        );
        let v6 = [addr("[fd00::8]:8080"), addr("[fd00::7]:8080")];
        assert_eq!(
            urls(&peer_urls(&v6, &me, |_| false)),
            ["http://[fd00::7]:8080", "http://[fd00::8]:8080"]
        );
        let me6 = SelfAddrs::new(addr("[fd00::7]:8080"), Vec::new());
        assert_eq!(
            urls(&peer_urls(&v6, &me6, |_| false)),
            ["http://[fd00::8]:8080"]
        );
        for u in peer_urls(&v6, &me, |_| false) {
            assert!(u.parse::<Uri>().is_ok(), "{u}");
        }
    }

    #[test]
    fn the_probe_knows_loopback_and_not_a_documentation_address() {
        assert!(is_local_ip("127.0.0.1".parse().unwrap()));
        assert!(!is_local_ip("192.0.2.1".parse().unwrap()));
    }

    #[test]
    fn failures_keep_the_set_and_are_reported_once() {
        let me = SelfAddrs::new(addr("127.0.0.1:8080"), Vec::new());
        let mut f = Follower::default();
        let two = || Ok(vec![addr("10.0.0.1:8080"), addr("10.0.0.2:8080")]);
        let first = f.step(two(), &me, |_| false);
        assert_eq!(first.transition, None);
        assert_eq!(
            urls(first.changed.as_ref().unwrap()),
            ["http://10.0.0.1:8080", "http://10.0.0.2:8080"]
        );
        // The same answer changes nothing.
        assert_eq!(f.step(two(), &me, |_| false), Step::default());
        // Failing: reported once, nothing applied.
        let failed = f.step(Err("no such host".into()), &me, |_| false);
        assert_eq!(
            failed,
            Step {
                changed: None,
                transition: Some(Transition::Failing("no such host".into())),
            }
        );
        assert_eq!(f.step(Err("again".into()), &me, |_| false), Step::default());
        // Back with the same set: reported, nothing to apply.
        assert_eq!(
            f.step(two(), &me, |_| false),
            Step {
                changed: None,
                transition: Some(Transition::Recovered),
            }
        );
        // A replica gone: the new set.
        let one = f.step(Ok(vec![addr("10.0.0.2:8080")]), &me, |_| false);
        assert_eq!(
            urls(one.changed.as_ref().unwrap()),
            ["http://10.0.0.2:8080"]
        );
        // Only this replica left: an empty set is applied too.
        let alone = f.step(Ok(vec![addr("127.0.0.1:8080")]), &me, |_| false);
        assert_eq!(alone.changed, Some(BTreeSet::new()));
    }

    #[test]
    fn a_first_failure_applies_nothing() {
        let me = SelfAddrs::new(addr("127.0.0.1:8080"), Vec::new());
        let mut f = Follower::default();
        let step = f.step(Err("down".into()), &me, |_| false);
        assert_eq!(step.changed, None);
        assert!(matches!(step.transition, Some(Transition::Failing(_))));
    }
}
