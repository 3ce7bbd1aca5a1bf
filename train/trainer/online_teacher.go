package trainer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"distill/cache"
	"distill/internal/errkind"
	"distill/internal/stall"
	"distill/internal/teacherdial"
	pb "distill/proto/distill/v1"
)

// ErrTeachers marks a run that lost its teachers: none was reachable for
// distill.teacher_timeout, or one refused the run's samples or
// credentials. Its text is in the chain only (errkind): the message
// names the teacher and what it did.
var ErrTeachers = errors.New("trainer: teachers")

// Retry pacing of a replica that failed: the first retry after
// retryMin, doubling up to retryMax. Variables so that tests of faults
// need not wait (they synchronize on hooks, never on these).
var (
	retryMin = 200 * time.Millisecond
	retryMax = 5 * time.Second
)

// replicaWindow bounds the samples one replica's Score stream has in
// flight: enough to keep a daemon's batcher fed, well under its
// per-stream window.
const replicaWindow = 64

// Test hooks (nil in production). testHookAnswer runs on a replica's
// receiving goroutine after its n-th answer; testHookPause runs when
// training pauses for want of a reachable teacher.
var (
	testHookAnswer func(addr string, n int64)
	// testHookAnswered runs beside testHookAnswer with the answered
	// sample's index.
	testHookAnswered func(index int64)
	testHookPause    func()
	// testInfoTimeout, when set, replaces teacher_timeout for the first
	// Info check only: a test of a short outage timeout must not also
	// race the start of the run against it.
	testInfoTimeout time.Duration
	// testStallClock, when set, is the stall watchdogs' clock.
	testStallClock stall.Clock
)

// scoreJob is one sample to score; done is closed once s holds the
// teacher's top-k.
type scoreJob struct {
	s    *cache.Sample
	done chan struct{}
	// then, if set, runs once the answer is in (before done is closed).
	then func(*scoreJob)
}

// replica is one address of a teacher.
type replica struct {
	addr    string
	conn    *grpc.ClientConn
	cl      pb.TeacherClient
	up      bool  // a Score stream is open
	checked bool  // Info matched at least once
	lastErr error // why it is down
	told    bool  // that it does not answer its first Info was said
	answers atomic.Int64
	// stallAt is its Status when its stream stalled (nil: it did not):
	// it gets a stream again once a forward pass has completed on it
	// since, or it was restarted (stall.Mended). Its Info, which a hung
	// daemon answers, says nothing. Only its loop uses it.
	stallAt *pb.StatusResponse
}

// teacherPool asks the replicas of one teacher for top-k through Score.
// Jobs wait in one queue that every replica's stream takes from, so a
// fast replica takes more; the jobs in flight on a replica that fails
// go back to the front of the queue for the others (and for it, once it
// is back). When no replica is up, training waits; after timeout the
// pool fails with ErrTeachers.
type teacherPool struct {
	name    string
	window  int   // samples in flight per replica
	k       int32 // asked per position (0 until Info: the teacher's default; 0 under sampled)
	temp    float32
	tg      scoreTargets
	timeout time.Duration
	stall   time.Duration // distill.stall_timeout (<= 0: none)
	log     io.Writer

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu        sync.Mutex
	cond      *sync.Cond
	reps      []*replica
	queue     []*scoreJob
	info      *pb.InfoResponse // the first replica's answer: the reference
	want      infoWant
	up        int
	started   bool // ready returned: every replica was checked
	paused    bool
	downSince time.Time
	err       error // fatal: the pool stopped
	asked     int64 // samples answered by the teachers
}

// infoWant is what every replica's Info must show.
type infoWant struct {
	tokenizer string
	vocab     int
	k         int32 // asked (0: the teacher's default)
	maxLen    int   // the longest sample the run sends
	draws     int32 // asked per position (sampled kinds; 0: none)
	// pretokenized: the run sends a pre-tokenized dataset's ids, which no
	// tokenizer made on either side: the vocabularies are compared, and
	// the tokenizers only where both the student and the daemon have one.
	pretokenized bool
}

// scoreTargets is the target kind a run asks its teachers for
// (distill.targets): with a sampled kind, N draws per position keyed by
// the dataset's fingerprint and each sample's index, as a fill's.
type scoreTargets struct {
	kind    cache.Targets
	draws   int32
	dataset string // the dataset's fingerprint
}

// newTeacherPool dials the replicas of teacher t (lazily) and starts
// their loops; ready waits for their Info checks.
func newTeacherPool(t TeacherConfig, o *OnlineConfig, want infoWant, tg scoreTargets, log io.Writer) (*teacherPool, error) {
	token := os.Getenv("DISTILL_TOKEN")
	if o.TokenFile != "" {
		var err error
		if token, err = teacherdial.ReadToken(o.TokenFile, "distill.token_file"); err != nil {
			return nil, errkind.Wrap(ErrConfig, err) // it names distill.token_file
		}
	}
	p := &teacherPool{name: t.Name, k: int32(o.K), temp: float32(o.CaptureTemperature), tg: tg, timeout: o.TeacherTimeout, stall: o.stallTimeout(), log: log, want: want}
	p.cond = sync.NewCond(&p.mu)
	p.ctx, p.cancel = context.WithCancel(context.Background())
	// A replica takes at most its share of the prefetch: the replicas
	// share the work even when the step outruns them all.
	p.window = max(1, min(replicaWindow, o.Prefetch/len(t.Addrs)))
	names := map[teacherdial.Option]string{teacherdial.Address: "distill.teachers address of teacher " + t.Name, teacherdial.CAFile: "distill.tls_ca"}
	for _, a := range t.Addrs {
		conn, err := teacherdial.Dial(a, teacherdial.Options{Token: token, CAFile: o.TLSCA, ServerName: o.TLSServerName, Names: names})
		if err != nil {
			p.close()
			return nil, errkind.Wrap(ErrConfig, err) // it names the key
		}
		p.reps = append(p.reps, &replica{addr: a, conn: conn, cl: pb.NewTeacherClient(conn)})
	}
	// Every replica must pass its Info check within teacher_timeout: the
	// run fails before step 1 otherwise.
	infoTimeout := p.timeout
	if testInfoTimeout > 0 {
		infoTimeout = testInfoTimeout
	}
	time.AfterFunc(infoTimeout, func() {
		p.mu.Lock()
		var why []string
		for _, r := range p.reps {
			if !r.checked {
				w := "no answer yet"
				if r.lastErr != nil {
					w = statusMessage(r.lastErr)
				}
				why = append(why, fmt.Sprintf("%s: %s", r.addr, w))
			}
		}
		late := !p.started && len(why) > 0
		p.mu.Unlock()
		if late {
			p.fail(errkind.Errorf(ErrTeachers, "teacher %s: replicas did not answer Info within distill.teacher_timeout %v (%s): start them, fix distill.teachers, or raise teacher_timeout",
				p.name, p.timeout, strings.Join(why, "; ")))
		}
	})
	for _, r := range p.reps {
		p.wg.Add(1)
		go p.loop(r)
	}
	return p, nil
}

// ready waits until every replica answered Info and matched: the checks
// before step 1. It returns the teacher's Info.
func (p *teacherPool) ready() (*pb.InfoResponse, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.err == nil {
		all := true
		for _, r := range p.reps {
			all = all && r.checked
		}
		if all {
			p.started = true
			return p.info, nil
		}
		p.cond.Wait()
	}
	return nil, p.err
}

// close stops the replicas' loops (their streams are cancelled) and
// closes the connections.
func (p *teacherPool) close() {
	p.cancel()
	p.mu.Lock()
	if p.err == nil {
		p.err = fmt.Errorf("%w: closed", ErrTeachers)
	}
	p.cond.Broadcast()
	p.mu.Unlock()
	p.wg.Wait()
	for _, r := range p.reps {
		r.conn.Close()
	}
}

// failed returns the pool's fatal error, nil while it works.
func (p *teacherPool) failed() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// submit queues j.
func (p *teacherPool) submit(j *scoreJob) {
	p.mu.Lock()
	p.queue = append(p.queue, j)
	p.cond.Broadcast()
	p.mu.Unlock()
}

// score asks for ss and waits for the answers (eval samples).
func (p *teacherPool) score(ss []*cache.Sample) error {
	jobs := make([]*scoreJob, 0, len(ss))
	for _, s := range ss {
		j := &scoreJob{s: s, done: make(chan struct{})}
		jobs = append(jobs, j)
		p.submit(j)
	}
	for _, j := range jobs {
		if err := p.wait(j); err != nil {
			return err
		}
	}
	return nil
}

// wait waits for j's answer, or the pool's failure.
func (p *teacherPool) wait(j *scoreJob) error {
	select {
	case <-j.done:
		return nil
	case <-p.ctx.Done():
		select {
		case <-j.done:
			return nil
		default:
		}
		return p.failed()
	}
}

// fail stops the pool with err (the first error wins).
func (p *teacherPool) fail(err error) {
	p.mu.Lock()
	if p.err == nil {
		p.err = err
	}
	p.cond.Broadcast()
	p.mu.Unlock()
	p.cancel()
}

// startPause records that no replica is up (p.mu held). The run fails
// if none comes back within the timeout.
func (p *teacherPool) startPause() {
	p.paused, p.downSince = true, time.Now()
	since := p.downSince
	time.AfterFunc(p.timeout, func() {
		p.mu.Lock()
		still := p.paused && p.downSince == since && p.err == nil
		var why []string
		for _, r := range p.reps {
			if r.lastErr != nil {
				why = append(why, fmt.Sprintf("%s: %s", r.addr, statusMessage(r.lastErr)))
			} else if !r.checked {
				why = append(why, fmt.Sprintf("%s: no answer", r.addr))
			}
		}
		p.mu.Unlock()
		if still {
			p.fail(errkind.Errorf(ErrTeachers, "no replica of teacher %s was reachable for distill.teacher_timeout %v (%s): start or fix the teachers, then rerun the same command to resume",
				p.name, p.timeout, strings.Join(why, "; ")))
		}
	})
	{
		var why []string
		for _, r := range p.reps {
			why = append(why, fmt.Sprintf("%s: %s", r.addr, statusMessage(r.lastErr)))
		}
		fmt.Fprintf(p.log, "teachers: no replica of teacher %s is reachable (%s): training paused; retrying, and giving up after distill.teacher_timeout %v\n",
			p.name, strings.Join(why, "; "), p.timeout)
		if testHookPause != nil {
			testHookPause()
		}
	}
}

// setUp marks r up (p.mu held).
func (p *teacherPool) setUp(r *replica) {
	if r.up {
		return
	}
	r.up, r.lastErr = true, nil
	p.up++
	if p.paused {
		fmt.Fprintf(p.log, "teachers: teacher %s is reachable again at %s after %v: training resumes\n", p.name, r.addr, time.Since(p.downSince).Round(time.Millisecond))
		p.paused = false
	}
}

// setDown marks r down after err (p.mu held).
func (p *teacherPool) setDown(r *replica, err error, retry time.Duration) {
	r.lastErr = err
	if !r.up {
		if !r.checked && !r.told {
			// Said once: the run waits for it up to teacher_timeout
			// (10m by default) and said nothing until then.
			r.told = true
			fmt.Fprintf(p.log, "teachers: teacher %s at %s does not answer (%s): retrying for up to distill.teacher_timeout %v (is teacherd running there? check distill.teachers, token_file and tls_ca)\n",
				p.name, r.addr, statusMessage(err), p.timeout)
		}
		return
	}
	r.up = false
	p.up--
	if p.up > 0 {
		fmt.Fprintf(p.log, "teachers: teacher %s replica %s failed (%s): its samples go to the other replicas; retrying it in %v\n", p.name, r.addr, statusMessage(err), retry)
		return
	}
	p.startPause()
}

// retryable reports whether err is a teacher that may come back (down,
// restarting, draining, overloaded) rather than one refusing the run.
func retryable(err error) bool {
	st, ok := status.FromError(err)
	if !ok {
		return false // ours: a mismatch or a refusal, named
	}
	switch st.Code() {
	case codes.Unavailable, codes.ResourceExhausted, codes.Aborted, codes.DeadlineExceeded, codes.Canceled, codes.Unknown:
		return true
	}
	return false
}

// loop runs replica r: a session (Info check, then a Score stream) until
// it fails, then a retry after a growing pause, until the pool closes.
func (p *teacherPool) loop(r *replica) {
	defer p.wg.Done()
	wait := retryMin
	for p.ctx.Err() == nil {
		progress, err := p.session(r)
		if p.ctx.Err() != nil {
			return
		}
		if !retryable(err) {
			p.fail(p.refused(r, err))
			return
		}
		if progress {
			wait = retryMin
		}
		p.mu.Lock()
		p.setDown(r, err, wait)
		p.mu.Unlock()
		t := time.NewTimer(wait)
		select {
		case <-p.ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		wait = min(2*wait, retryMax)
	}
}

// statusMessage is err's gRPC message, without "rpc error: code = ...",
// and a failed connection said as what happened to it
// (teacherdial.Message).
func statusMessage(err error) string { return teacherdial.Message(err) }

// refused names the teacher and the replica of an error of a session
// that no retry mends: a daemon's refusal of Info (a missing or wrong
// token) came out bare, "rpc error: code = Unauthenticated desc = ...",
// naming neither, with the daemon's hint for cachectl fill (endSession
// names a Score stream's). Our own errors (checkInfo's) name them
// already.
func (p *teacherPool) refused(r *replica, err error) error {
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	hint := ""
	if c := st.Code(); c == codes.Unauthenticated || c == codes.PermissionDenied {
		hint = ": give the daemon's bearer token in distill.token_file (or $DISTILL_TOKEN)" // as endSession says it
	}
	return errkind.Errorf(ErrTeachers, "teacher %s at %s refused the run: %s%s", p.name, r.addr, st.Message(), hint)
}

// checkInfo compares a replica's Info with the run's needs and the other
// replicas' (p.mu held), naming the mismatch.
func (p *teacherPool) checkInfo(r *replica, in *pb.InfoResponse) error {
	bad := func(format string, a ...any) error {
		return errkind.Errorf(ErrMismatch, "teacher %s at %s: %s", p.name, r.addr, fmt.Sprintf(format, a...))
	}
	w := p.want
	sampled := p.tg.kind == cache.TargetsSampled // no head: k is not asked
	// Pre-tokenized ids need no tokenizer on either side: the tokenizers
	// are compared only where both have one (as cachectl fill
	// --pretokenized, whose cache records none).
	checkTok := !w.pretokenized || (in.GetTokenizerFingerprint() != "" && !strings.HasPrefix(w.tokenizer, "pretokenized:"))
	switch {
	case checkTok && in.GetTokenizerFingerprint() == "":
		return bad("the daemon has no tokenizer, so the student's tokenizer (%.12s) cannot be checked against it: start teacherd with --tokenizer (the student's tokenizer directory)", w.tokenizer)
	case checkTok && in.GetTokenizerFingerprint() != w.tokenizer:
		return bad("tokenizer %s, but the student's tokenizer is %s: teacher and student must share a tokenizer; start teacherd with the student's --tokenizer, or train a student with the teacher's tokenizer", in.GetTokenizerFingerprint(), w.tokenizer)
	case int(in.GetVocabSize()) != w.vocab:
		return bad("vocab_size %d, but the student has %d: the teacher and student must share a vocabulary", in.GetVocabSize(), w.vocab)
	case w.k > in.GetKMax():
		return bad("distill.k %d exceeds the daemon's k_max %d: lower distill.k, or start teacherd with --k-max %d", w.k, in.GetKMax(), w.k)
	case w.k == 0 && in.GetKDefault() <= 0 && !sampled:
		return bad("the daemon has no default k: set distill.k")
	case w.draws > in.GetMaxDraws():
		return bad("distill.samples %d exceeds the daemon's max_draws %d (the draws per position it plans its memory for; 0: a teacherd that serves no sampled targets): lower distill.samples, or start teacherd with --max-draws %d",
			w.draws, in.GetMaxDraws(), w.draws)
	case int(min(in.GetMaxPositions(), in.GetTokenBudget())) < w.maxLen:
		return bad("accepts samples of at most %d tokens (max_positions %d, token_budget %d), but the run's samples may have %d (data.seq_len / data.dataset.max_len): lower max_len, or start teacherd with a larger --token-budget",
			min(in.GetMaxPositions(), in.GetTokenBudget()), in.GetMaxPositions(), in.GetTokenBudget(), w.maxLen)
	}
	if ref := p.info; ref != nil {
		kr, ki := w.k, w.k
		if w.k == 0 {
			kr, ki = ref.GetKDefault(), in.GetKDefault()
		}
		switch {
		case in.GetTeacherFingerprint() != ref.GetTeacherFingerprint():
			return bad("teacher fingerprint %.12s, but the other replicas serve %.12s: the addresses of one teacher must serve the same model (%s): give each model its own teachers entry",
				in.GetTeacherFingerprint(), ref.GetTeacherFingerprint(), in.GetModelDir())
		case kr != ki && !sampled:
			return bad("default k %d, but the other replicas use %d: set distill.k", ki, kr)
		}
	}
	return nil
}

// session checks r's Info, opens a Score stream and scores queued jobs
// on it until the stream fails; the jobs in flight then go back to the
// front of the queue. progress reports whether any job was answered.
func (p *teacherPool) session(r *replica) (progress bool, err error) {
	ctx, cancel := context.WithCancel(p.ctx)
	defer cancel()
	if err := p.checkReplica(ctx, r); err != nil {
		return false, err
	}
	if err := p.unstalled(ctx, r); err != nil {
		return false, err
	}
	stream, err := r.cl.Score(ctx)
	if err != nil {
		return false, err
	}
	p.mu.Lock()
	p.setUp(r)
	p.mu.Unlock()

	// The sender takes jobs while fewer than the window are in flight;
	// this goroutine receives the answers in order.
	fl := &flight{slots: make(chan struct{}, p.window)}
	// The stall watchdog: nothing (an answer, a progress message) for
	// distill.stall_timeout while samples are in flight cancels the
	// stream, and the replica counts as failed.
	fl.wd = stall.Start(p.stall, testStallClock, fl.busy, func(time.Duration) { cancel() })
	wake := context.AfterFunc(ctx, func() { p.mu.Lock(); p.cond.Broadcast(); p.mu.Unlock() })
	defer wake()
	var swg sync.WaitGroup
	swg.Add(1)
	go func() {
		defer swg.Done()
		p.send(ctx, cancel, stream, fl)
	}()
	progress, rerr := p.receive(r, stream, fl)
	cancel()
	swg.Wait()
	if waited, stalled := fl.wd.Stop(); stalled && p.ctx.Err() == nil {
		rerr = p.stalled(r, fl, waited)
	}
	return progress, p.endSession(r, fl, rerr)
}

// stalled is the error of r's stream that its watchdog cancelled (it
// names the samples in flight, the wait and the key), and keeps r's
// Status now, for unstalled.
func (p *teacherPool) stalled(r *replica, fl *flight, waited time.Duration) error {
	fl.mu.Lock()
	what := "the samples in flight"
	if n := len(fl.jobs); n > 0 {
		what = fmt.Sprintf("sample %d", fl.jobs[0].s.Index)
		if n > 1 {
			what += fmt.Sprintf(" and %d more in flight", n-1)
		}
	}
	fl.mu.Unlock()
	ctx, cancel := context.WithTimeout(p.ctx, 30*time.Second)
	st, err := r.cl.Status(ctx, &pb.StatusRequest{})
	cancel()
	if err == nil {
		r.stallAt = st
	}
	return &stall.Error{Addr: r.addr, What: what, Waited: waited, Flag: "distill.stall_timeout"}
}

// unstalled checks that r, if its stream stalled, has completed a
// forward pass since or was restarted (stall.Recheck); its error (a
// retryable one) keeps r down.
func (p *teacherPool) unstalled(ctx context.Context, r *replica) error {
	if r.stallAt == nil {
		return nil
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ask := func(ctx context.Context) (*pb.StatusResponse, error) { return r.cl.Status(ctx, &pb.StatusRequest{}) }
	if err := stall.Recheck(sctx, ask, r.stallAt, "distill.stall_timeout", p.stall); err != nil {
		return err
	}
	r.stallAt = nil
	return nil
}

// flight is a Score stream's jobs sent and not answered yet, in the
// order sent, shared by its sender and its receiver; slots bounds them.
type flight struct {
	mu      sync.Mutex
	jobs    []*scoreJob
	sendErr error // why the sender stopped, if it failed
	slots   chan struct{}
	wd      *stall.Watchdog // nil: none (distill.stall_timeout 0)
}

// busy reports whether answers are owed: the watchdog counts only then
// (an idle stream, the step having all it asked for, is no stall).
func (fl *flight) busy() bool {
	fl.mu.Lock()
	defer fl.mu.Unlock()
	return len(fl.jobs) > 0
}

// checkReplica asks r's Info and checks it (checkInfo); the first
// replica's answer becomes the pool's reference.
func (p *teacherPool) checkReplica(ctx context.Context, r *replica) error {
	ictx, icancel := context.WithTimeout(ctx, 30*time.Second)
	in, err := r.cl.Info(ictx, &pb.InfoRequest{})
	icancel()
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.checkInfo(r, in); err != nil {
		return err
	}
	if p.info == nil {
		p.info = in
		if p.k == 0 && p.tg.kind != cache.TargetsSampled {
			p.k = in.GetKDefault()
		}
	}
	r.checked = true
	p.cond.Broadcast()
	return nil
}

// send takes queued jobs onto the stream while a slot is free, until ctx
// ends or a send fails (then it cancels the session).
func (p *teacherPool) send(ctx context.Context, cancel context.CancelFunc, stream pb.Teacher_ScoreClient, fl *flight) {
	var id int64
	for {
		select {
		case fl.slots <- struct{}{}:
		case <-ctx.Done():
			return
		}
		j := p.nextJob(ctx, fl)
		if j == nil {
			return
		}
		if err := stream.Send(p.request(id, j.s)); err != nil {
			fl.mu.Lock()
			fl.sendErr = err
			fl.mu.Unlock()
			cancel()
			return
		}
		id++
	}
}

// request is the Score request of sample s, under id.
func (p *teacherPool) request(id int64, s *cache.Sample) *pb.ScoreRequest {
	r := &pb.ScoreRequest{Id: id, Tokens: s.Tokens, Temperature: p.temp, Progress: true}
	if k := p.k; p.tg.kind != cache.TargetsSampled {
		r.K = &k
	}
	if p.tg.kind != cache.TargetsTopK {
		r.Targets, r.Samples, r.DatasetFingerprint, r.SampleIndex = string(p.tg.kind), p.tg.draws, p.tg.dataset, s.Index
	}
	return r
}

// nextJob waits for a queued job and moves it into flight (nil once ctx
// ends).
func (p *teacherPool) nextJob(ctx context.Context, fl *flight) *scoreJob {
	p.mu.Lock()
	defer p.mu.Unlock()
	for len(p.queue) == 0 && ctx.Err() == nil {
		p.cond.Wait()
	}
	if ctx.Err() != nil {
		return nil
	}
	j := p.queue[0]
	p.queue[0] = nil
	p.queue = p.queue[1:]
	fl.mu.Lock()
	if len(fl.jobs) == 0 {
		fl.wd.Alive() // answers are owed from now
	}
	fl.jobs = append(fl.jobs, j)
	fl.mu.Unlock()
	return j
}

// receive takes the stream's answers in order, each for the oldest job
// in flight, until the stream fails or an answer is wrong.
func (p *teacherPool) receive(r *replica, stream pb.Teacher_ScoreClient, fl *flight) (progress bool, err error) {
	var recvID int64
	for {
		res, err := stream.Recv()
		if err != nil {
			return progress, err
		}
		fl.wd.Alive()
		if res.GetProgress() != nil {
			continue // the daemon works on what is in flight: no answer yet
		}
		var j *scoreJob
		fl.mu.Lock()
		if len(fl.jobs) == 0 {
			err = status.Errorf(codes.Internal, "teacher %s at %s answered sample id %d that was not asked", p.name, r.addr, res.GetId())
		} else if verr := checkAnswer(fl.jobs[0].s, res, recvID, p.k, p.tg); verr != nil {
			err = status.Errorf(codes.Internal, "teacher %s at %s: %v", p.name, r.addr, verr)
		} else {
			j = fl.jobs[0]
			fl.jobs = fl.jobs[1:]
		}
		fl.mu.Unlock()
		if err != nil {
			return progress, err
		}
		j.s.TopKIDs, j.s.TopKLogProbs = res.GetIds(), res.GetLogprobs()
		if p.tg.kind != cache.TargetsTopK {
			j.s.DrawN, j.s.DrawIDs, j.s.DrawCounts, j.s.TailMass = res.GetDrawN(), res.GetDrawIds(), res.GetDrawCounts(), res.GetTailMass()
		}
		recvID++
		progress = true
		p.deliver(r, j, fl)
	}
}

// deliver completes an answered job: counted, its then run, its done
// closed, its slot freed.
func (p *teacherPool) deliver(r *replica, j *scoreJob, fl *flight) {
	p.mu.Lock()
	p.asked++
	p.mu.Unlock()
	if j.then != nil {
		j.then(j)
	}
	close(j.done)
	<-fl.slots
	n := r.answers.Add(1)
	if testHookAnswer != nil {
		testHookAnswer(r.addr, n)
	}
	if testHookAnswered != nil {
		testHookAnswered(j.s.Index)
	}
}

// endSession puts the jobs still in flight back at the front of the
// queue, for the other replicas and for r once it is back, and says why
// the session ended: a refused sample or credentials end the run
// (ErrTeachers); other errors are retried.
func (p *teacherPool) endSession(r *replica, fl *flight, rerr error) error {
	fl.mu.Lock()
	if fl.sendErr != nil && (rerr == nil || errors.Is(rerr, io.EOF)) {
		rerr = fl.sendErr
	}
	back := fl.jobs
	fl.jobs = nil
	fl.mu.Unlock()
	p.mu.Lock()
	p.queue = append(back, p.queue...)
	p.cond.Broadcast()
	p.mu.Unlock()
	if errors.Is(rerr, io.EOF) {
		rerr = status.Error(codes.Unavailable, "the daemon ended the Score stream")
	}
	if status.Code(rerr) == codes.InvalidArgument && len(back) > 0 {
		s := back[0].s
		return errkind.Errorf(ErrTeachers, "teacher %s at %s refused sample %d (%d tokens): %v", p.name, r.addr, s.Index, len(s.Tokens), status.Convert(rerr).Message())
	}
	if c := status.Code(rerr); c == codes.Unauthenticated || c == codes.PermissionDenied {
		return errkind.Errorf(ErrTeachers, "teacher %s at %s: %v: give the daemon's bearer token in distill.token_file (or $DISTILL_TOKEN)", p.name, r.addr, status.Convert(rerr).Message())
	}
	return rerr
}

// checkAnswer checks a Score response against its request: its top-k,
// and under a sampled kind its draws' shape (what the cache writer
// and the packer index by).
func checkAnswer(s *cache.Sample, res *pb.ScoreResponse, id int64, k int32, tg scoreTargets) error {
	T := len(s.Tokens)
	switch {
	case res.GetId() != id:
		return fmt.Errorf("answer id %d, want %d (answers out of order)", res.GetId(), id)
	case res.GetK() != k:
		return fmt.Errorf("sample %d: answer has k %d, asked %d", s.Index, res.GetK(), k)
	case len(res.GetIds()) != T*int(k) || len(res.GetLogprobs()) != T*int(k):
		return fmt.Errorf("sample %d: answer has %d ids and %d log-probs, want %d x %d", s.Index, len(res.GetIds()), len(res.GetLogprobs()), T, k)
	}
	if tg.kind == cache.TargetsTopK {
		return nil
	}
	nd := 0
	for _, n := range res.GetDrawN() {
		if n < 0 || n > tg.draws {
			return fmt.Errorf("sample %d: answer has %d distinct draws at a position, asked %d draws", s.Index, n, tg.draws)
		}
		nd += int(n)
	}
	wantTail := 0
	if tg.kind == cache.TargetsHeadSampled {
		wantTail = T
	}
	switch {
	case len(res.GetDrawN()) != T:
		return fmt.Errorf("sample %d: answer has draws at %d positions, want %d (targets %s: an older teacherd answers top-k only)", s.Index, len(res.GetDrawN()), T, tg.kind)
	case len(res.GetDrawIds()) != nd || len(res.GetDrawCounts()) != nd:
		return fmt.Errorf("sample %d: answer has %d drawn ids and %d counts, want %d (the sum of draw_n)", s.Index, len(res.GetDrawIds()), len(res.GetDrawCounts()), nd)
	case len(res.GetTailMass()) != wantTail:
		return fmt.Errorf("sample %d: answer has %d tail masses, want %d (targets %s)", s.Index, len(res.GetTailMass()), wantTail, tg.kind)
	}
	return nil
}

// asked returns the samples the teachers have answered.
func (p *teacherPool) answered() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.asked
}
