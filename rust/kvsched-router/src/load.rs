//! A replica's load: the last snapshot its caller reported, plus the requests the router sent it since.
//!
//! A snapshot (`LoadReport`) is the truth when it is taken, but it misses every request routed after it; without
//! a correction a burst of decisions between two snapshots would all land on the replica that looked idlest.
//! So each replica counts the requests routed to it since its last snapshot (`pending_*`): they count as waiting
//! (their uncached prompt tokens as queued prefill tokens) until the caller marks their prefill done, then as
//! running, and they leave when they finish. A new snapshot supersedes them (it includes them, or they are
//! over). Without any snapshot the router's own count of in-flight requests is the load. Invariant: the pending
//! counts equal the sums over the in-flight requests routed in the current epoch.

use crate::error::{Result, RouterError};

/// Load signals of one replica. Counts of requests and tokens; `kv_usage` is the used share of its KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadReport {
    pub num_waiting: u64,
    pub num_running: u64,
    /// Prompt tokens the waiting requests still have to compute (their uncached prefill).
    pub num_waiting_tokens: u64,
    /// Context tokens of the running requests (what their decode steps attend to).
    pub num_running_tokens: u64,
    pub kv_usage: f64,
}

impl LoadReport {
    pub fn validate(&self) -> Result<()> {
        if !(self.kv_usage.is_finite() && (0.0..=1.0).contains(&self.kv_usage)) {
            return Err(RouterError::InvalidArgument(format!(
                "kv_usage must be in [0, 1], got {}",
                self.kv_usage
            )));
        }
        Ok(())
    }

    /// Requests on the replica, waiting or running: the load of the balance rule.
    pub fn num_requests(&self) -> u64 {
        self.num_waiting + self.num_running
    }
}

#[derive(Clone, Debug, Default)]
pub struct ReplicaLoad {
    report: LoadReport,
    /// Bumped by every snapshot; a request routed in an older epoch is inside a snapshot already.
    epoch: u64,
    pending_waiting: u64,
    pending_waiting_tokens: u64,
    pending_running: u64,
    pending_running_tokens: u64,
}

/// What the load needs to know about one in-flight request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pending {
    pub epoch: u64,
    pub uncached_tokens: u64,
    pub num_tokens: u64,
    pub prefilled: bool,
}

impl ReplicaLoad {
    pub fn report(&mut self, report: LoadReport) {
        self.report = report;
        self.epoch += 1;
        self.pending_waiting = 0;
        self.pending_waiting_tokens = 0;
        self.pending_running = 0;
        self.pending_running_tokens = 0;
    }

    /// The load the policies see.
    pub fn effective(&self) -> LoadReport {
        let r = &self.report;
        LoadReport {
            num_waiting: r.num_waiting + self.pending_waiting,
            num_running: r.num_running + self.pending_running,
            num_waiting_tokens: r.num_waiting_tokens + self.pending_waiting_tokens,
            num_running_tokens: r.num_running_tokens + self.pending_running_tokens,
            kv_usage: r.kv_usage,
        }
    }

    /// Counts a request routed here now.
    pub fn routed(&mut self, uncached_tokens: u64, num_tokens: u64) -> Pending {
        self.pending_waiting += 1;
        self.pending_waiting_tokens += uncached_tokens;
        Pending { epoch: self.epoch, uncached_tokens, num_tokens, prefilled: false }
    }

    pub fn prefill_done(&mut self, p: &mut Pending) {
        if p.prefilled {
            return;
        }
        if p.epoch == self.epoch {
            self.pending_waiting = self.pending_waiting.saturating_sub(1);
            self.pending_waiting_tokens = self.pending_waiting_tokens.saturating_sub(p.uncached_tokens);
            self.pending_running += 1;
            self.pending_running_tokens += p.num_tokens;
        }
        p.prefilled = true;
    }

    pub fn finished(&mut self, p: &Pending) {
        if p.epoch != self.epoch {
            return;
        }
        if p.prefilled {
            self.pending_running = self.pending_running.saturating_sub(1);
            self.pending_running_tokens = self.pending_running_tokens.saturating_sub(p.num_tokens);
        } else {
            self.pending_waiting = self.pending_waiting.saturating_sub(1);
            self.pending_waiting_tokens = self.pending_waiting_tokens.saturating_sub(p.uncached_tokens);
        }
    }

    /// The pending counts a set of in-flight requests adds up to (for `check_invariants`).
    pub fn check(&self, in_flight: &[Pending]) -> Result<()> {
        let mut sums = [0u64; 4];
        for p in in_flight.iter().filter(|p| p.epoch == self.epoch) {
            if p.prefilled {
                sums[2] += 1;
                sums[3] += p.num_tokens;
            } else {
                sums[0] += 1;
                sums[1] += p.uncached_tokens;
            }
        }
        let have = [
            self.pending_waiting,
            self.pending_waiting_tokens,
            self.pending_running,
            self.pending_running_tokens,
        ];
        if sums != have {
            return Err(RouterError::Internal(format!("pending load {have:?} != in-flight sums {sums:?}")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routed_requests_count_until_a_snapshot_supersedes_them() {
        let mut l = ReplicaLoad::default();
        let mut a = l.routed(100, 120);
        let b = l.routed(50, 50);
        assert_eq!(
            (l.effective().num_waiting, l.effective().num_waiting_tokens, l.effective().num_running),
            (2, 150, 0)
        );
        l.prefill_done(&mut a);
        l.prefill_done(&mut a); // twice is once
        assert_eq!(
            (l.effective().num_waiting, l.effective().num_running, l.effective().num_running_tokens),
            (1, 1, 120)
        );
        l.check(&[a, b]).unwrap();
        l.report(LoadReport { num_waiting: 3, num_running: 4, kv_usage: 0.5, ..Default::default() });
        let c = l.routed(10, 10);
        l.finished(&a); // routed before the snapshot: inside it already
        l.finished(&b);
        assert_eq!((l.effective().num_waiting, l.effective().num_running), (4, 4));
        l.check(&[c]).unwrap();
        l.finished(&c);
        assert_eq!(l.effective().num_requests(), 7);
        assert!(LoadReport { kv_usage: 1.5, ..Default::default() }.validate().is_err());
        assert!(LoadReport { kv_usage: f64::NAN, ..Default::default() }.validate().is_err());
    }
}
