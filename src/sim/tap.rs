//! A tap on the wire between a VM's lifecycle and its store: what the store told each stream
//! about its key. The oracle reads it only to deny the `pass` excuse to a request the store
//! told that its key was in progress or done (docs/behaviour.md §3.8: `on_unavailable: "pass"`
//! is for requests the plugin knows nothing about).

use std::cell::RefCell;
use std::rc::Rc;

use crate::encoding::StoredResponse;
use crate::store::{Answer, Began, CallAnswer, CallRequest, Claim, For, Owner, Store, TickReport};

/// Streams the store told of their key (in progress, done, or used with another request).
pub type Told = Rc<RefCell<Vec<u32>>>;

pub struct Tap {
    pub inner: Box<dyn Store>,
    pub told: Told,
}

impl Tap {
    fn note(&self, who: For, answer: &Answer) {
        let knows = matches!(
            answer,
            Answer::Began(Began::InProgress | Began::Replay(_) | Began::CompletedWithoutBody | Began::Mismatch)
        );
        if let (For::Stream(id), true) = (who, knows) {
            self.told.borrow_mut().push(id);
        }
    }
}

impl Store for Tap {
    fn begin(&mut self, who: For, claim: &Claim, now_ms: u64) -> Option<Answer> {
        let answer = self.inner.begin(who, claim, now_ms);
        if let Some(a) = &answer {
            self.note(who, a);
        }
        answer
    }
    fn renew(&mut self, owner: Owner, lease_ms: u64, now_ms: u64) -> Option<Answer> {
        self.inner.renew(owner, lease_ms, now_ms)
    }
    fn complete(
        &mut self,
        owner: Owner,
        response: Option<Rc<StoredResponse>>,
        retention_ms: u64,
        now_ms: u64,
    ) -> Option<Answer> {
        self.inner.complete(owner, response, retention_ms, now_ms)
    }
    fn release(&mut self, owner: Owner, now_ms: u64) -> Option<Answer> {
        self.inner.release(owner, now_ms)
    }
    fn forget(&mut self, owner: Owner) {
        self.inner.forget(owner)
    }
    fn tick(&mut self, now_ms: u64) -> TickReport {
        self.inner.tick(now_ms)
    }
    fn poll_answer(&mut self) -> Option<(For, Answer)> {
        let answer = self.inner.poll_answer();
        if let Some((who, a)) = &answer {
            self.note(*who, a);
        }
        answer
    }
    fn poll_call(&mut self) -> Option<(u64, CallRequest)> {
        self.inner.poll_call()
    }
    fn poll_count(&mut self) -> Option<crate::metrics::Counter> {
        self.inner.poll_count()
    }
    fn on_call_answer(&mut self, call: u64, answer: &CallAnswer, now_ms: u64) {
        self.inner.on_call_answer(call, answer, now_ms)
    }
    fn on_call_failed(&mut self, call: u64, now_ms: u64) {
        self.inner.on_call_failed(call, now_ms)
    }
    fn wait_poll_ms(&self) -> u64 {
        self.inner.wait_poll_ms()
    }
    fn answers_at_once(&self) -> bool {
        self.inner.answers_at_once()
    }
    fn write_wait_ms(&self) -> u64 {
        self.inner.write_wait_ms()
    }
    fn is_idle(&self) -> bool {
        self.inner.is_idle()
    }
    fn busy(&self) -> Vec<(&'static str, usize)> {
        self.inner.busy()
    }
}
