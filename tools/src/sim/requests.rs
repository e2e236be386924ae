//! The simulated traffic: requests with varied prompt and generation lengths arriving over the
//! steps, all drawn from one seed.

use super::rng::SplitMix;

/// One request as it arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    pub id: usize,
    /// The step from which it may be scheduled.
    pub arrival_step: usize,
    pub prompt_len: usize,
    /// Tokens it generates (the first comes out of its last prefill chunk).
    pub gen_len: usize,
}

impl RequestSpec {
    /// Tokens whose K/V it writes: the prompt and every generated token but the last.
    pub fn total_tokens(&self) -> usize {
        self.prompt_len + self.gen_len - 1
    }
}

/// The shape of the traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workload {
    pub num_requests: usize,
    /// Inclusive ranges.
    pub prompt_len: (usize, usize),
    pub gen_len: (usize, usize),
    /// Requests there at step 0.
    pub initial: usize,
    /// Then 0..=this many arrive each step.
    pub max_arrivals_per_step: usize,
}

impl Workload {
    /// The longest context a request reaches.
    pub fn max_model_len(&self) -> usize {
        self.prompt_len.1 + self.gen_len.1 - 1
    }

    /// Every request, in arrival order.
    pub fn generate(&self, rng: &mut SplitMix) -> Vec<RequestSpec> {
        let mut step = 0;
        let mut arriving_now = self.initial;
        let mut out = Vec::with_capacity(self.num_requests);
        while out.len() < self.num_requests {
            if arriving_now == 0 {
                step += 1;
                arriving_now = rng.range(0, self.max_arrivals_per_step.max(1));
                continue;
            }
            out.push(RequestSpec {
                id: out.len(),
                arrival_step: step,
                prompt_len: rng.range(self.prompt_len.0.max(1), self.prompt_len.1.max(1)),
                gen_len: rng.range(self.gen_len.0.max(1), self.gen_len.1.max(1)),
            });
            arriving_now -= 1;
        }
        out
    }
}
