//! A split plan's arrays packed into one word buffer (each array at a 16-byte-aligned offset),
//! so that one copy moves the whole plan: a step's plans ([`crate::forward`]), a
//! [`BatchPlan`](crate::batch_plan::BatchPlan)'s and a direct call's ([`super::DecodeWorkspace`]).

use super::split::DecodePlan;
use crate::words::{append, Region, ALIGN_WORDS};

/// One plan's arrays in a word buffer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PlanRegions {
    pub items: Region,
    pub req_num_splits: Region,
    pub req_partial_base: Region,
    pub token_request: Region,
    /// `[num_items, chunk, 0, 0]`: what a kernel launched over a fixed grid reads.
    pub header: Region,
}

/// Words [`append_plan`] adds for a plan of these sizes, padding included.
pub(crate) fn plan_words(items: usize, reqs: usize, tokens: usize) -> usize {
    let padded = |n: usize| n.next_multiple_of(ALIGN_WORDS);
    padded(items) + 2 * padded(reqs) + padded(tokens) + padded(4)
}

pub(crate) fn append_plan(words: &mut Vec<u32>, plan: &DecodePlan) -> PlanRegions {
    PlanRegions {
        items: append(words, plan.items.iter().copied()),
        req_num_splits: append(words, plan.req_num_splits.iter().copied()),
        req_partial_base: append(words, plan.req_partial_base.iter().copied()),
        token_request: append(words, plan.token_request.iter().copied()),
        header: append(words, [(plan.items.len() / 2) as u32, plan.chunk, 0, 0]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_words_bounds_what_append_plan_writes() {
        for (items, reqs, tokens) in [(0, 0, 0), (1, 1, 1), (6, 3, 5), (64, 17, 33)] {
            let plan = DecodePlan {
                items: vec![7; items],
                req_num_splits: vec![1; reqs],
                req_partial_base: vec![0; reqs],
                token_request: vec![0; tokens],
                ..DecodePlan::default()
            };
            let mut words = Vec::new();
            let r = append_plan(&mut words, &plan);
            assert_eq!(words.len(), plan_words(items, reqs, tokens));
            for region in [r.items, r.req_num_splits, r.req_partial_base, r.token_request, r.header] {
                assert_eq!(region.offset % ALIGN_WORDS, 0);
            }
            assert_eq!(&words[r.items.range()], &plan.items[..]);
            assert_eq!(words[r.header.offset], (items / 2) as u32);
        }
    }
}
