//! A burst against one limit, then an all-or-nothing check of two limits: what the library
//! decides and what it tells a caller. Run with
//! `cargo run --release -p tollgate --example quickstart`.

use tollgate::{Clock, Item, Limit, MemoryStore, MonotonicClock, RateLimiter};

fn main() -> Result<(), tollgate::Error> {
    // 5 requests of burst, refilled at 2 per second.
    let limit = Limit::new(5, "2/s".parse()?)?;
    let limiter = RateLimiter::with_limit(limit);
    println!("limit: {limit}");
    for attempt in 1..=7 {
        let decision = limiter.check("alice")?;
        match decision.retry_after() {
            None => println!(
                "request {attempt}: allowed, {} left, full again in {:?}",
                decision.remaining(),
                decision.reset_after()
            ),
            Some(wait) => println!("request {attempt}: rejected, retry after {wait:?}"),
        }
    }

    // Two limits on one request: per user and per tenant. The second request fits the user's
    // bucket but not the tenant's, so it is refused and the user is charged nothing either.
    let clock = MonotonicClock::new();
    let store: MemoryStore<Box<str>> = MemoryStore::builder().build();
    let per_user = Limit::new(10, "10/s".parse()?)?;
    let per_tenant = Limit::new(5, "1/s".parse()?)?;
    for attempt in 1..=2 {
        let request = [
            Item {
                key: "user:alice",
                limit: &per_user,
                cost: 3,
            },
            Item {
                key: "tenant:acme",
                limit: &per_tenant,
                cost: 3,
            },
        ];
        let decisions = store.check_all(&request, clock.now(), None)?;
        let allowed = decisions.iter().all(|d| d.allowed());
        let remaining: Vec<u64> = decisions.iter().map(|d| d.remaining()).collect();
        println!(
            "two-limit request {attempt}: allowed {allowed}, user and tenant tokens {remaining:?}"
        );
    }
    Ok(())
}
