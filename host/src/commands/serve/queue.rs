//! The job queue between the HTTP handlers and the model's worker thread.
//!
//! Handlers [`Queue::submit`] a job and await its reply on a oneshot
//! channel; each replica's worker (one per device the model is loaded on,
//! `--replicas`) takes the oldest waiting job ([`Queue::next`]), so with
//! two replicas two jobs run at once, and reports its progress
//! ([`Queue::progress`]). At most `bound` jobs wait behind the running
//! ones: a submission beyond that is refused ([`Full`], which the API turns
//! into 503 with `Retry-After`).
//!
//! Cancellation: [`Queue::cancel`] removes a waiting job, or sets the
//! running job's flag and its replica's backends' abort flag (so a CPU
//! computation stops inside a graph, not only between steps). Both happen
//! under the queue's lock, and a worker clears its abort flag under the
//! same lock when it starts a job, so a cancellation can never hit the next
//! job, nor a job on another replica.
//! A handler holds a [`Ticket`]: when its future is dropped (the client
//! disconnected) the ticket cancels the job.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::oneshot;

/// Why a job ended without a result.
#[derive(Debug)]
pub enum JobError {
    /// Interrupted or cancelled by its client (409).
    Cancelled(String),
    /// Still waiting when the server began to stop (503).
    Stopping(String),
    /// The request was invalid for the loaded model (422).
    Invalid(String),
    /// Anything else (500).
    Failed(String),
}

/// A job's outcome.
pub type Reply<T> = Result<T, JobError>;

/// A queued job: the work, its cancel flag and where its reply goes.
pub struct Job<W, T> {
    /// Queue-wide id.
    pub id: u64,
    /// What to do.
    pub work: W,
    /// Set when the job is cancelled.
    pub cancel: Arc<AtomicBool>,
    /// Set by A1111's interrupt: finish with what is made so far.
    pub interrupt: Arc<AtomicBool>,
    /// Set by A1111's skip: finish the current image with what is made so
    /// far and go on with the next (the worker clears it).
    pub skip: Arc<AtomicBool>,
    /// Where the result goes (the handler may be gone).
    pub reply: oneshot::Sender<Reply<T>>,
    /// The one replica that may run it (`None`: any).
    pub replica: Option<usize>,
}

/// The submission was refused: `bound` jobs are already waiting.
#[derive(Debug)]
pub struct Full;

/// A running job's progress.
#[derive(Clone, Debug)]
pub struct Running {
    /// Its id.
    pub id: u64,
    /// The replica running it (index into `--replicas`).
    pub replica: usize,
    /// Its kind, for `/progress` (`txt2img`, `img2img`, `load`).
    pub kind: &'static str,
    /// Sampling step done within the current image.
    pub step: usize,
    /// Steps per image.
    pub steps: usize,
    /// Images finished.
    pub images_done: usize,
    /// Images to make.
    pub images: usize,
    /// When it started.
    pub started: Instant,
    /// Wall-clock start, seconds since the epoch (A1111's job_timestamp).
    pub timestamp: u64,
    /// The latest live preview, a base64 PNG (A1111's `current_image`).
    pub preview: Option<Arc<str>>,
    cancel: Arc<AtomicBool>,
    interrupt: Arc<AtomicBool>,
    skip: Arc<AtomicBool>,
}

impl Running {
    /// Fraction done, 0..1.
    pub fn fraction(&self) -> f64 {
        if self.images == 0 || self.steps == 0 {
            return 0.0;
        }
        let img = self.step.min(self.steps) as f64 / self.steps as f64;
        ((self.images_done as f64 + img) / self.images as f64).min(1.0)
    }
}

/// Counts of finished jobs (for `/health`).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Counters {
    /// Jobs accepted.
    pub submitted: u64,
    /// Jobs that succeeded.
    pub done: u64,
    /// Jobs cancelled (interrupt, disconnect, shutdown).
    pub cancelled: u64,
    /// Jobs that failed.
    pub failed: u64,
    /// Submissions refused because the queue was full.
    pub rejected: u64,
}

struct Inner<W, T> {
    pending: VecDeque<Job<W, T>>,
    /// One entry per busy replica, oldest job first.
    running: Vec<Running>,
    closed: bool,
    next_id: u64,
    counters: Counters,
}

/// The FIFO queue (see the module docs).
pub struct Queue<W, T> {
    inner: Mutex<Inner<W, T>>,
    cv: Condvar,
    bound: usize,
    /// Each replica's backends' abort flag.
    aborts: Vec<Arc<AtomicBool>>,
}

/// A submitted job's handle: cancels the job when dropped before
/// [`Ticket::finish`].
pub struct Ticket<W: JobKind, T> {
    queue: Arc<Queue<W, T>>,
    id: u64,
    finished: bool,
}

/// What the queue needs to know about a job's work.
pub trait JobKind {
    /// Its kind for `/progress`.
    fn kind(&self) -> &'static str;
    /// `(steps per image, images)` for progress.
    fn size(&self) -> (usize, usize);
}

impl<W: JobKind, T> Ticket<W, T> {
    /// The job's id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The reply arrived: dropping no longer cancels.
    pub fn finish(mut self) {
        self.finished = true;
    }
}

impl<W: JobKind, T> Drop for Ticket<W, T> {
    fn drop(&mut self) {
        if !self.finished && self.queue.cancel(self.id, "the client went away") {
            tracing::info!("job {}: the client disconnected; cancelled", self.id);
        }
    }
}

impl<W: JobKind, T> Queue<W, T> {
    /// A queue of at most `bound` waiting jobs for one worker per replica;
    /// `aborts` holds each replica's backends' abort flag.
    pub fn new(bound: usize, aborts: Vec<Arc<AtomicBool>>) -> Arc<Self> {
        Arc::new(Queue {
            inner: Mutex::new(Inner {
                pending: VecDeque::new(),
                running: Vec::new(),
                closed: false,
                next_id: 1,
                counters: Counters::default(),
            }),
            cv: Condvar::new(),
            bound,
            aborts,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner<W, T>> {
        // A panic while holding the lock leaves plain data behind: go on.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `work`; the reply arrives on the receiver.
    #[allow(clippy::type_complexity)]
    pub fn submit(
        self: &Arc<Self>,
        work: W,
    ) -> Result<(Ticket<W, T>, oneshot::Receiver<Reply<T>>), Full> {
        self.submit_to(work, None)
    }

    /// The number of replicas (workers) the queue serves.
    pub fn replicas(&self) -> usize {
        self.aborts.len()
    }

    /// Queues `work` for `replica` alone (`None`: any replica), behind the
    /// jobs already waiting; other replicas pass it by.
    #[allow(clippy::type_complexity)]
    pub fn submit_to(
        self: &Arc<Self>,
        work: W,
        replica: Option<usize>,
    ) -> Result<(Ticket<W, T>, oneshot::Receiver<Reply<T>>), Full> {
        let mut g = self.lock();
        if g.closed {
            return Err(Full);
        }
        if g.pending.len() >= self.bound {
            g.counters.rejected += 1;
            return Err(Full);
        }
        let id = g.next_id;
        g.next_id += 1;
        g.counters.submitted += 1;
        let (tx, rx) = oneshot::channel();
        g.pending.push_back(Job {
            id,
            work,
            cancel: Arc::new(AtomicBool::new(false)),
            interrupt: Arc::new(AtomicBool::new(false)),
            skip: Arc::new(AtomicBool::new(false)),
            reply: tx,
            replica,
        });
        drop(g);
        self.cv.notify_all();
        Ok((
            Ticket {
                queue: self.clone(),
                id,
                finished: false,
            },
            rx,
        ))
    }

    /// The next job for `replica`'s worker, blocking; `None` once the queue
    /// is closed and empty. A replica runs one job at a time: it calls
    /// [`Queue::finished`] before asking again.
    pub fn next(&self, replica: usize) -> Option<Job<W, T>> {
        let mut g = self.lock();
        loop {
            let mine = g
                .pending
                .iter()
                .position(|j| j.replica.is_none_or(|r| r == replica));
            if let Some(job) = mine.and_then(|i| g.pending.remove(i)) {
                let (steps, images) = job.work.size();
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                g.running.retain(|r| r.replica != replica);
                g.running.push(Running {
                    id: job.id,
                    replica,
                    kind: job.work.kind(),
                    step: 0,
                    steps,
                    images_done: 0,
                    images,
                    started: Instant::now(),
                    timestamp: now,
                    preview: None,
                    cancel: job.cancel.clone(),
                    interrupt: job.interrupt.clone(),
                    skip: job.skip.clone(),
                });
                g.running.sort_by_key(|r| r.id);
                self.aborts[replica].store(false, Ordering::SeqCst);
                return Some(job);
            }
            if g.closed {
                return None;
            }
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// `replica`'s running job finished (`ok`: with a result; `cancelled`:
    /// by a cancellation).
    pub fn finished(&self, replica: usize, ok: bool, cancelled: bool) {
        let mut g = self.lock();
        g.running.retain(|r| r.replica != replica);
        match (ok, cancelled) {
            (true, _) => g.counters.done += 1,
            (false, true) => g.counters.cancelled += 1,
            (false, false) => g.counters.failed += 1,
        }
    }

    /// Progress of `replica`'s running job: `step` of the current image,
    /// and the images finished.
    pub fn progress(&self, replica: usize, step: usize, images_done: usize) {
        if let Some(r) = self
            .lock()
            .running
            .iter_mut()
            .find(|r| r.replica == replica)
        {
            r.step = step;
            r.images_done = images_done;
        }
    }

    /// A live preview of `replica`'s running job (a base64 PNG).
    pub fn set_preview(&self, replica: usize, png_base64: Arc<str>) {
        if let Some(r) = self
            .lock()
            .running
            .iter_mut()
            .find(|r| r.replica == replica)
        {
            r.preview = Some(png_base64);
        }
    }

    /// Running job `id`'s latest live preview and the images it finished.
    pub fn preview_of(&self, id: u64) -> Option<(Arc<str>, usize)> {
        let g = self.lock();
        let r = g.running.iter().find(|r| r.id == id)?;
        Some((r.preview.clone()?, r.images_done))
    }

    /// Cancels job `id`, waiting or running; whether it was found.
    pub fn cancel(&self, id: u64, why: &str) -> bool {
        let mut g = self.lock();
        if let Some(pos) = g.pending.iter().position(|j| j.id == id) {
            let job = g.pending.remove(pos).expect("found above");
            g.counters.cancelled += 1;
            drop(g);
            job.cancel.store(true, Ordering::SeqCst);
            let _ = job.reply.send(Err(JobError::Cancelled(why.into())));
            return true;
        }
        match g.running.iter().find(|r| r.id == id) {
            Some(r) => {
                r.cancel.store(true, Ordering::SeqCst);
                self.aborts[r.replica].store(true, Ordering::SeqCst);
                true
            }
            None => false,
        }
    }

    /// A1111's interrupt: every running job finishes after its current
    /// step with what it has made (its images so far, the current one from
    /// its last denoised estimate); their ids.
    pub fn interrupt(&self) -> Vec<u64> {
        let g = self.lock();
        for r in &g.running {
            r.interrupt.store(true, Ordering::SeqCst);
        }
        g.running.iter().map(|r| r.id).collect()
    }

    /// A1111's skip: every running job finishes its current image after
    /// the current step and goes on with the next; their ids.
    pub fn skip(&self) -> Vec<u64> {
        let g = self.lock();
        for r in &g.running {
            r.skip.store(true, Ordering::SeqCst);
        }
        g.running.iter().map(|r| r.id).collect()
    }

    /// Cancels every running job at once (shutdown after its grace
    /// period); their ids.
    pub fn cancel_running(&self) -> Vec<u64> {
        let g = self.lock();
        for r in &g.running {
            r.cancel.store(true, Ordering::SeqCst);
            self.aborts[r.replica].store(true, Ordering::SeqCst);
        }
        g.running.iter().map(|r| r.id).collect()
    }

    /// Refuses new jobs and cancels the waiting ones; the running ones go
    /// on (see [`Queue::cancel_running`]). [`Queue::next`] returns `None` after.
    pub fn close(&self) {
        let mut g = self.lock();
        g.closed = true;
        let dropped: Vec<_> = g.pending.drain(..).collect();
        g.counters.cancelled += dropped.len() as u64;
        drop(g);
        for job in dropped {
            job.cancel.store(true, Ordering::SeqCst);
            let _ = job.reply.send(Err(JobError::Stopping(
                "the server is shutting down".into(),
            )));
        }
        self.cv.notify_all();
    }

    /// `(running jobs, oldest first; waiting jobs; counters)`.
    pub fn snapshot(&self) -> (Vec<Running>, usize, Counters) {
        let g = self.lock();
        (g.running.clone(), g.pending.len(), g.counters)
    }

    /// The bound on waiting jobs.
    pub fn bound(&self) -> usize {
        self.bound
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct W(usize);
    impl JobKind for W {
        fn kind(&self) -> &'static str {
            "test"
        }
        fn size(&self) -> (usize, usize) {
            (self.0, 1)
        }
    }

    /// Jobs still waiting when the server stops are answered "stopping"
    /// (503), not "cancelled" (409), and no job is taken after it.
    #[test]
    fn closing_answers_waiting_jobs_stopping() {
        let q: Arc<Queue<W, ()>> = Queue::new(4, vec![Arc::new(AtomicBool::new(false))]);
        let (_t1, _r1) = q.submit(W(1)).unwrap();
        let running = q.next(0).unwrap();
        let (_t2, mut r2) = q.submit(W(2)).unwrap();
        q.close();
        assert!(matches!(r2.try_recv(), Ok(Err(JobError::Stopping(_)))));
        assert!(q.submit(W(3)).is_err(), "a closed queue takes no job");
        assert!(q.next(0).is_none());
        drop(running);
    }

    #[test]
    fn fifo_bound_and_cancellation() {
        let abort = Arc::new(AtomicBool::new(false));
        let q: Arc<Queue<W, ()>> = Queue::new(2, vec![abort.clone()]);
        let (t1, _r1) = q.submit(W(1)).unwrap();
        let (t2, mut r2) = q.submit(W(2)).unwrap();
        assert!(q.submit(W(3)).is_err(), "a third waiting job is refused");
        assert_eq!(q.snapshot().2.rejected, 1);
        let j1 = q.next(0).unwrap();
        assert_eq!(j1.work.0, 1);
        // One running, one waiting: room for one more.
        let (t3, _r3) = q.submit(W(3)).unwrap();
        // A dropped ticket of a waiting job removes it and answers it.
        drop(t2);
        assert!(matches!(r2.try_recv(), Ok(Err(JobError::Cancelled(_)))));
        // Interrupting asks the running job only to finish early (no
        // abort of the step it is in); skipping, its current image.
        assert_eq!(q.interrupt(), vec![j1.id]);
        assert!(j1.interrupt.load(Ordering::SeqCst) && !j1.cancel.load(Ordering::SeqCst));
        assert!(!abort.load(Ordering::SeqCst));
        assert_eq!(q.skip(), vec![j1.id]);
        assert!(j1.skip.load(Ordering::SeqCst));
        // Cancelling the running jobs (shutdown) stops the step too.
        assert_eq!(q.cancel_running(), vec![j1.id]);
        assert!(j1.cancel.load(Ordering::SeqCst) && abort.load(Ordering::SeqCst));
        q.finished(0, false, true);
        t1.finish();
        // The next job starts with the abort flag cleared.
        let j3 = q.next(0).unwrap();
        assert_eq!((j3.work.0, j3.id), (3, t3.id()));
        assert!(!abort.load(Ordering::SeqCst) && !j3.cancel.load(Ordering::SeqCst));
        q.progress(0, 1, 0);
        assert_eq!(q.snapshot().0[0].fraction(), 1.0 / 3.0);
        t3.finish();
        q.finished(0, true, false);
        q.close();
        assert!(q.next(0).is_none());
        let c = q.snapshot().2;
        assert_eq!((c.submitted, c.done, c.cancelled), (3, 1, 2));
    }

    #[test]
    fn two_replicas_run_two_jobs_and_cancel_apart() {
        let aborts = vec![
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        ];
        let q: Arc<Queue<W, ()>> = Queue::new(4, aborts.clone());
        let tickets: Vec<_> = (1..=3).map(|n| q.submit(W(n)).unwrap()).collect();
        // Each replica takes the oldest waiting job: two run at once.
        let a = q.next(1).unwrap();
        let b = q.next(0).unwrap();
        assert_eq!((a.work.0, b.work.0), (1, 2));
        let (running, waiting, _) = q.snapshot();
        let ids: Vec<_> = running.iter().map(|r| (r.id, r.replica)).collect();
        assert_eq!((ids, waiting), (vec![(a.id, 1), (b.id, 0)], 1));
        // Progress and cancellation reach only the job's own replica.
        q.progress(0, 1, 0);
        let (running, _, _) = q.snapshot();
        assert_eq!((running[0].step, running[1].step), (0, 1));
        assert!(q.cancel(b.id, "test"));
        assert!(b.cancel.load(Ordering::SeqCst) && aborts[0].load(Ordering::SeqCst));
        assert!(!a.cancel.load(Ordering::SeqCst) && !aborts[1].load(Ordering::SeqCst));
        q.finished(0, false, true);
        // Replica 0 takes the third job with its abort flag cleared, while
        // replica 1 still runs the first.
        let c = q.next(0).unwrap();
        assert_eq!(c.work.0, 3);
        assert!(!aborts[0].load(Ordering::SeqCst));
        assert_eq!(q.snapshot().0.len(), 2);
        // Interrupt reaches both; cancelling the running ones stops both.
        assert_eq!(q.interrupt(), vec![a.id, c.id]);
        assert!(a.interrupt.load(Ordering::SeqCst) && c.interrupt.load(Ordering::SeqCst));
        assert_eq!(q.cancel_running(), vec![a.id, c.id]);
        assert!(aborts[0].load(Ordering::SeqCst) && aborts[1].load(Ordering::SeqCst));
        q.finished(1, false, true);
        q.finished(0, false, true);
        assert!(q.snapshot().0.is_empty());
        for (t, _) in tickets {
            t.finish();
        }
    }

    #[test]
    fn a_job_for_one_replica_is_passed_by_the_others() {
        let aborts = vec![
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        ];
        let q: Arc<Queue<W, ()>> = Queue::new(4, aborts);
        assert_eq!(q.replicas(), 2);
        let (t1, _) = q.submit_to(W(1), Some(1)).unwrap();
        let (t2, _) = q.submit(W(2)).unwrap();
        // Replica 0 passes the first job by and takes the second.
        assert_eq!(q.next(0).unwrap().work.0, 2);
        assert_eq!(q.next(1).unwrap().work.0, 1);
        q.finished(0, true, false);
        q.finished(1, true, false);
        // Waiting for its replica, a targeted job still counts against
        // the bound and is cancelled like any other.
        let (t3, mut r3) = q.submit_to(W(3), Some(0)).unwrap();
        assert_eq!(q.snapshot().1, 1);
        drop(t3);
        assert!(matches!(r3.try_recv(), Ok(Err(JobError::Cancelled(_)))));
        t1.finish();
        t2.finish();
    }
}
