//! `session_id` is a soft signal: a session's last instance likely holds its conversation even
//! when the prompt was edited so that the prefix index matches nothing, but it never pins.

use switchyard_core::{
    InstanceId, InstanceSpec, Observation, RequestId, RouteRequest, Router, RouterConfig,
};

fn fleet(n: usize) -> (Router, Vec<InstanceId>) {
    let mut router = Router::new(RouterConfig::default()).unwrap();
    let ids = (0..n)
        .map(|i| {
            router
                .add_instance(InstanceSpec::new(format!("i{i}"), "m"))
                .unwrap()
        })
        .collect();
    (router, ids)
}

fn words(seed: u64, tokens: usize) -> String {
    (0..tokens)
        .map(|i| format!("s{seed}w{i} "))
        .collect::<String>()
}

/// Routes and completes one request; returns where it went.
fn serve(router: &mut Router, id: u64, request: &RouteRequest<'_>, now: f64) -> InstanceId {
    let decision = router.route(request, now).unwrap();
    let instance = decision.best().unwrap();
    let plan = decision.plan_for(instance);
    let request = RequestId(id);
    router
        .observe(
            Observation::Routed {
                request,
                instance,
                plan,
            },
            now,
        )
        .unwrap();
    router
        .observe(Observation::FirstToken(request), now + 0.05)
        .unwrap();
    router
        .observe(Observation::Finished(request, None), now + 0.1)
        .unwrap();
    instance
}

#[test]
fn an_edited_conversation_goes_back_to_its_session_instance() {
    let (mut router, _) = fleet(4);
    let mut stayed = 0;
    for s in 0..20u64 {
        let session = format!("user-{s}");
        let first = words(s, 400);
        let mut req = RouteRequest::text("m", &first);
        req.session_id = Some(&session);
        let t = s as f64 * 10.0;
        let went = serve(&mut router, s * 2, &req, t);
        // The client rewrote the start of the conversation: no block of it matches any more.
        let edited = format!("(edited) {first}");
        let mut again = RouteRequest::text("m", &edited);
        again.session_id = Some(&session);
        let decision = router.route(&again, t + 1.0).unwrap();
        let terms = decision.candidate(went).unwrap().terms;
        assert_eq!(terms.matched_blocks, 0, "the edit leaves nothing to match");
        assert!(
            terms.cached_tokens > 0,
            "the session's instance is expected to hold some"
        );
        if decision.best() == Some(went) {
            stayed += 1;
        }
    }
    assert_eq!(stayed, 20);
}

#[test]
fn a_session_never_pins_to_a_busy_instance() {
    let (mut router, _) = fleet(2);
    let session = "user-busy".to_string();
    let text = words(1, 400);
    let mut req = RouteRequest::text("m", &text);
    req.session_id = Some(&session);
    let went = serve(&mut router, 1, &req, 0.0);
    // Pile prefill work on that instance: many long requests without a first token yet.
    for k in 0..40u64 {
        let other = words(100 + k, 2000);
        let decision = router.route(&RouteRequest::text("m", &other), 1.0).unwrap();
        let plan = decision.plan_for(went);
        router
            .observe(
                Observation::Routed {
                    request: RequestId(100 + k),
                    instance: went,
                    plan,
                },
                1.0,
            )
            .unwrap();
    }
    let edited = format!("(edited) {text}");
    let mut again = RouteRequest::text("m", &edited);
    again.session_id = Some(&session);
    let decision = router.route(&again, 2.0).unwrap();
    assert_ne!(decision.best(), Some(went), "{}", decision.explain(2));
}
