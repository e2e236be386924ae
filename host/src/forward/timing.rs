//! Where a layer's time goes: the cache write and the attention, measured with `Instant` on the
//! CPU and with CUDA events on the GPU (read back, after the stream catches up, by
//! [`Attention::take_times`](super::Attention::take_times)).

use crate::error::Result;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use std::time::{Duration, Instant};

/// Time spent in the layers since the last [`take_times`](super::Attention::take_times).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PhaseTimes {
    /// Writing the new K/V into the caches.
    pub cache_write: Duration,
    /// Decode and prefill attention.
    pub attention: Duration,
    /// Layers measured.
    pub layers: usize,
}

impl std::ops::AddAssign for PhaseTimes {
    fn add_assign(&mut self, o: PhaseTimes) {
        self.cache_write += o.cache_write;
        self.attention += o.attention;
        self.layers += o.layers;
    }
}

/// A point in a layer: a host instant, or an event recorded on the stream.
#[derive(Clone, Copy)]
pub(crate) enum Mark {
    Off,
    At(Instant),
    Event(usize),
}

/// The phase timer of an [`Attention`](super::Attention).
#[derive(Default)]
pub(crate) struct Timer {
    pub(crate) enabled: bool,
    times: PhaseTimes,
    /// Reused events; `0..next` are recorded since the last take.
    events: Vec<CudaEvent>,
    next: usize,
    /// Each layer's (start, after write, end) events.
    pending: Vec<[usize; 3]>,
}

impl Timer {
    /// Marks now: on the host, or (with `stream`) on the stream.
    pub(crate) fn mark(&mut self, stream: Option<&CudaStream>) -> Result<Mark> {
        if !self.enabled {
            return Ok(Mark::Off);
        }
        let Some(stream) = stream else { return Ok(Mark::At(Instant::now())) };
        if self.next == self.events.len() {
            self.events.push(stream.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?);
        }
        self.events[self.next].record(stream)?;
        self.next += 1;
        Ok(Mark::Event(self.next - 1))
    }

    /// Books one layer from its three marks.
    pub(crate) fn layer(&mut self, marks: [Mark; 3]) {
        match marks {
            [Mark::At(a), Mark::At(b), Mark::At(c)] => {
                self.times.cache_write += b - a;
                self.times.attention += c - b;
                self.times.layers += 1;
            }
            [Mark::Event(a), Mark::Event(b), Mark::Event(c)] => self.pending.push([a, b, c]),
            _ => {}
        }
    }

    /// The times since the last take (waiting for the recorded events), and a fresh start.
    pub(crate) fn take(&mut self) -> Result<PhaseTimes> {
        let ms = |ms: f32| Duration::from_secs_f64(ms.max(0.0) as f64 * 1e-3);
        for [a, b, c] in std::mem::take(&mut self.pending) {
            self.times.cache_write += ms(self.events[a].elapsed_ms(&self.events[b])?);
            self.times.attention += ms(self.events[b].elapsed_ms(&self.events[c])?);
            self.times.layers += 1;
        }
        self.next = 0;
        Ok(std::mem::take(&mut self.times))
    }
}
