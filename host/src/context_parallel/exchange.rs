//! How the ranks of a group move their parts ([`CpExchange`]), and [`LocalGroup`]: the exchange
//! for ranks that share one device, one thread each.

use crate::error::{ensure, AttnError, Result};
use cudarc::driver::{CudaEvent, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use std::sync::{Arc, Condvar, Mutex};

/// An all-gather among the ranks of a context-parallel group: every rank's `send` bytes land in
/// every rank's `recv`, rank `i`'s at `i * send.len()`, ordered on the caller's stream. Every
/// rank of the group calls it the same number of times with parts of the same size (as NCCL's
/// collectives are called); a rank that stops calling leaves the others waiting.
pub trait CpExchange: Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// The all-gather, enqueued on `stream` after what it already holds. `recv` holds at least
    /// `world_size * send.len()` bytes (the caller checks).
    fn all_gather(&mut self, stream: &Arc<CudaStream>, send: &CudaView<'_, u8>, recv: &mut CudaViewMut<'_, u8>) -> Result<()>;
}

/// What each rank posts in one phase of a [`LocalGroup`] all-gather.
struct Post {
    ptr: u64,
    bytes: usize,
    /// Recorded on the poster's stream after the work the others must wait for.
    ready: CudaEvent,
}

/// A barrier that a rank leaving the group (its exchange dropped, e.g. after an error) breaks:
/// the others' waits then fail instead of waiting for ever.
struct GroupBarrier {
    state: Mutex<BarrierState>,
    turn: Condvar,
}

struct BarrierState {
    world: usize,
    arrived: usize,
    generation: u64,
    /// The rank that left, once one has.
    left: Option<usize>,
}

impl GroupBarrier {
    fn new(world: usize) -> Self {
        GroupBarrier { state: Mutex::new(BarrierState { world, arrived: 0, generation: 0, left: None }), turn: Condvar::new() }
    }

    fn wait(&self, rank: usize) -> Result<()> {
        let mut s = self.state.lock().expect("the barrier's lock");
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == s.world {
            s.arrived = 0;
            s.generation += 1;
            self.turn.notify_all();
        }
        while s.generation == generation && s.left.is_none() {
            s = self.turn.wait(s).expect("the barrier's lock");
        }
        match s.left {
            Some(gone) if s.generation == generation => {
                Err(AttnError::invalid("exchange", format!("rank {rank} waits for rank {gone}, which left the group")))
            }
            _ => Ok(()),
        }
    }

    fn leave(&self, rank: usize) {
        let mut s = self.state.lock().expect("the barrier's lock");
        s.left.get_or_insert(rank);
        self.turn.notify_all();
    }
}

struct Shared {
    world: usize,
    barrier: GroupBarrier,
    /// Phase 0: each rank's part is written; phase 1: each rank has copied every part.
    posts: Mutex<[Vec<Option<Post>>; 2]>,
}

/// Ranks of a group on one device, each driven by its own thread with its own stream: the
/// all-gather is device-to-device copies, ordered by events. Made once for the group
/// ([`LocalGroup::new`]), one [`CpExchange`] a rank.
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalGroup {
    /// The exchanges of a group of `world_size` ranks, rank 0 first.
    ///
    /// Errors: a group of no rank.
    pub fn new(world_size: usize) -> Result<Vec<LocalGroup>> {
        ensure(world_size >= 1, "world_size", || "0: a group has at least one rank".into())?;
        let none = || (0..world_size).map(|_| None).collect::<Vec<_>>();
        let shared = Arc::new(Shared { world: world_size, barrier: GroupBarrier::new(world_size), posts: Mutex::new([none(), none()]) });
        Ok((0..world_size).map(|rank| LocalGroup { rank, shared: shared.clone() }).collect())
    }

    fn post(&self, phase: usize, post: Post) {
        self.shared.posts.lock().expect("the posts' lock")[phase][self.rank] = Some(post);
    }
}

impl Drop for LocalGroup {
    fn drop(&mut self) {
        self.shared.barrier.leave(self.rank);
    }
}

impl CpExchange for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_gather(&mut self, stream: &Arc<CudaStream>, send: &CudaView<'_, u8>, recv: &mut CudaViewMut<'_, u8>) -> Result<()> {
        let (n, bytes) = (self.shared.world, send.len());
        let (send_ptr, _send_order) = send.device_ptr(stream);
        self.post(0, Post { ptr: send_ptr, bytes, ready: stream.record_event(None)? });
        self.shared.barrier.wait(self.rank)?;
        let recv_len = recv.len();
        let (recv_ptr, _recv_order) = recv.device_ptr_mut(stream);
        let copied = {
            let posts = self.shared.posts.lock().expect("the posts' lock");
            let parts: Vec<&Post> = posts[0].iter().map(|p| p.as_ref().expect("every rank posted before the barrier")).collect();
            // Every rank sees the same posts, so every rank refuses a mismatch alike.
            let sizes_agree = parts.iter().all(|p| p.bytes == bytes) && recv_len >= n * bytes;
            if sizes_agree {
                for (i, p) in parts.iter().enumerate() {
                    stream.wait(&p.ready)?;
                    // SAFETY: `p.ptr` is rank i's part of `bytes` bytes, kept until every rank
                    // has copied it (phase 1 below); `recv` holds `n * bytes` (checked).
                    unsafe { cudarc::driver::result::memcpy_dtod_async(recv_ptr + (i * bytes) as u64, p.ptr, bytes, stream.cu_stream()) }?;
                }
            }
            sizes_agree.then_some(())
        };
        // Phase 1: no rank writes its part again (the next layer) before every rank copied it.
        self.post(1, Post { ptr: 0, bytes: 0, ready: stream.record_event(None)? });
        self.shared.barrier.wait(self.rank)?;
        {
            let posts = self.shared.posts.lock().expect("the posts' lock");
            for p in posts[1].iter().flatten() {
                stream.wait(&p.ready)?;
            }
        }
        copied.ok_or_else(|| {
            AttnError::invalid("send", format!("rank {}'s part of {bytes} bytes: the ranks' parts differ in size", self.rank))
        })
    }
}
