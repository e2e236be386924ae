//! [`Held`]: memory the library owns and uses exclusively, which the CUDA graphs captured from
//! it must keep allocated after the owner is dropped.

use crate::buffer::KeepAlive;
use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// A value (workspaces, a step's device buffer, status words) with one owner that reads and
/// writes it, and any number of [`keep_alive`](Self::keep_alive) handles that only delay its
/// drop: a graph replays kernels that use the value's device memory, so the graph holds such a
/// handle, and the value is dropped (its memory freed) with the last of the owner and handles.
///
/// The owner's accesses cost what a `Box`'s do: no lock, no count.
pub(crate) struct Held<T> {
    inner: Arc<HeldCell<T>>,
}

struct HeldCell<T>(UnsafeCell<T>);

// SAFETY: the value is reached only through the one `Held` (not `Clone`): `&T` through `&Held`,
// `&mut T` through `&mut Held`, so sharing the cell across threads shares what `T: Sync`
// allows. The keep-alive handles are `Arc<dyn Any>`s of this private type, so they can only be
// dropped, and whichever holder is last drops the value (`T: Send`).
unsafe impl<T: Send + Sync> Sync for HeldCell<T> {}

impl<T: Send + Sync + 'static> Held<T> {
    pub(crate) fn new(value: T) -> Self {
        Held { inner: Arc::new(HeldCell(UnsafeCell::new(value))) }
    }

    /// A handle that keeps the value alive and gives no access to it.
    pub(crate) fn keep_alive(&self) -> KeepAlive {
        self.inner.clone()
    }

    /// Whether `handle` is one of this value's keep-alive handles.
    pub(crate) fn is(&self, handle: &KeepAlive) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.inner), Arc::as_ptr(handle))
    }
}

impl<T> Deref for Held<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: only this owner reaches the value (see `HeldCell`); `&self` allows no `&mut T`.
        unsafe { &*self.inner.0.get() }
    }
}

impl<T> DerefMut for Held<T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: only this owner reaches the value, and `&mut self` is exclusive.
        unsafe { &mut *self.inner.0.get() }
    }
}
