package dist

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"distill/internal/cli"
)

// DefaultGrace is how long Launch lets the other ranks end on their own
// after one failed, and then after SIGTERM, before it kills them.
const DefaultGrace = 10 * time.Second

// LaunchOptions configure Launch.
type LaunchOptions struct {
	// NProc is the number of ranks to start on this node (at least 1).
	NProc int
	// Path is the program each rank runs ("": this executable) with Args
	// (without the program name).
	Path string
	Args []string
	// Env is the ranks' environment before Launch adds its variables
	// (nil: this process's).
	Env []string
	// Stdout and Stderr receive the ranks' output, each line prefixed
	// with "[rank N] " (nil: this process's). Log receives Launch's own
	// lines (nil: Stderr).
	Stdout, Stderr, Log io.Writer
	// Grace is DefaultGrace when 0.
	Grace time.Duration
	// Signals are forwarded to every running rank (nil: this process's
	// SIGINT and SIGTERM).
	Signals <-chan os.Signal
}

// The variables Launch sets for each rank, dropped from the environment
// it is given.
var launchVars = []string{"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", EnvListenFD, EnvReportFD}

// Launch runs NProc ranks of one program on this node, as torchrun
// --nproc-per-node does: rank i gets RANK=i, LOCAL_RANK=i, WORLD_SIZE and
// LOCAL_WORLD_SIZE=NProc, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT,
// whose socket rank 0 inherits already listening ($DISTILL_RDZV_LISTEN_FD),
// so no other process can take it first. Their output is forwarded line
// by line with the rank as prefix; SIGINT and SIGTERM are forwarded to
// them (they run in their own process group, so a terminal's Ctrl-C
// reaches them once, through Launch).
//
// When a rank fails (exits non-zero, or is killed), the others get Grace
// to end on their own (the control plane tells them), then SIGTERM, then
// after Grace again SIGKILL; Launch returns a *RankError naming the rank
// and its status, with the others' after it. When a forwarded signal
// ended the ranks, it returns a *cli.Interrupted with that signal. It
// returns nil when every rank exits 0.
func Launch(o LaunchOptions) error {
	if o.NProc < 1 {
		return fmt.Errorf("dist: --nproc-per-node %d: want at least 1", o.NProc)
	}
	if o.Path == "" {
		exe, err := os.Executable()
		if err != nil {
			return fmt.Errorf("dist: launch: this executable: %w", err)
		}
		o.Path = exe
	}
	if o.Env == nil {
		o.Env = os.Environ()
	}
	if o.Stdout == nil {
		o.Stdout = os.Stdout
	}
	if o.Stderr == nil {
		o.Stderr = os.Stderr
	}
	if o.Log == nil {
		o.Log = o.Stderr
	}
	if o.Grace <= 0 {
		o.Grace = DefaultGrace
	}
	if o.Signals == nil {
		ch := make(chan os.Signal, 4)
		signal.Notify(ch, syscall.SIGINT, syscall.SIGTERM)
		defer signal.Stop(ch)
		o.Signals = ch
	}
	// Pdeathsig follows the thread that started a rank: keep it alive.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("dist: launch: a rendezvous port on 127.0.0.1: %w", err)
	}
	lisFile, err := lis.(*net.TCPListener).File()
	lis.Close() // the duplicate in lisFile keeps the socket listening
	if err != nil {
		return fmt.Errorf("dist: launch: %w", err)
	}
	defer lisFile.Close()
	port := lis.Addr().(*net.TCPAddr).Port
	base := withoutVars(o.Env, launchVars)

	var outMu, errMu sync.Mutex
	ranks := make([]*exec.Cmd, o.NProc)
	writers := make([]*lineWriter, 0, 2*o.NProc)
	exits := make(chan rankExit, o.NProc)
	blames := make(chan int, 4*o.NProc)
	var reading sync.WaitGroup
	for r := range o.NProc {
		c := exec.Command(o.Path, o.Args...)
		c.Env = append(base, "RANK="+strconv.Itoa(r), "LOCAL_RANK="+strconv.Itoa(r), "WORLD_SIZE="+strconv.Itoa(o.NProc),
			"LOCAL_WORLD_SIZE="+strconv.Itoa(o.NProc), "MASTER_ADDR=127.0.0.1", "MASTER_PORT="+strconv.Itoa(port))
		report, reportW, err := os.Pipe()
		if err != nil {
			return fmt.Errorf("dist: launch: %w", err)
		}
		c.ExtraFiles = []*os.File{reportW} // descriptor 3, and the listener 4
		c.Env = append(c.Env, EnvReportFD+"=3")
		if r == 0 {
			c.ExtraFiles = append(c.ExtraFiles, lisFile)
			c.Env = append(c.Env, EnvListenFD+"=4")
		}
		prefix := fmt.Sprintf("[rank %d] ", r)
		stdout, stderr := &lineWriter{w: o.Stdout, mu: &outMu, prefix: prefix}, &lineWriter{w: o.Stderr, mu: &errMu, prefix: prefix}
		writers = append(writers, stdout, stderr)
		c.Stdout, c.Stderr = stdout, stderr
		c.SysProcAttr = rankProcAttr()
		c.WaitDelay = o.Grace // a rank's children holding its output
		err = c.Start()
		reportW.Close()
		if err != nil {
			report.Close()
			for _, s := range ranks[:r] {
				s.Process.Kill()
				s.Wait()
			}
			return fmt.Errorf("dist: launch rank %d: %w", r, err)
		}
		ranks[r] = c
		reading.Add(1)
		go func() {
			defer reading.Done()
			readBlames(report, o.NProc, blames)
		}()
		go func() {
			c.Wait()
			stdout.flush()
			stderr.flush()
			exits <- rankExit{r, c.ProcessState}
		}()
	}
	lisFile.Close() // rank 0 has its own
	fmt.Fprintf(o.Log, "launch: started %d ranks (pids %s), rendezvous at 127.0.0.1:%d\n", o.NProc, pids(ranks), port)
	return superviseRanks(ranks, exits, blames, &reading, o)
}

// readBlames passes on the rank numbers a rank's report pipe carries.
func readBlames(f *os.File, world int, out chan<- int) {
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if r, err := strconv.Atoi(sc.Text()); err == nil && r >= 0 && r < world {
			select {
			case out <- r:
			default: // enough said
			}
		}
	}
}

type rankExit struct {
	rank  int
	state *os.ProcessState
}

// superviseRanks waits for every rank, forwarding signals, and stops the
// others when one fails.
func superviseRanks(ranks []*exec.Cmd, exits <-chan rankExit, blames chan int, reading *sync.WaitGroup, o LaunchOptions) error {
	running := make([]bool, len(ranks))
	for i := range running {
		running[i] = true
	}
	signalAll := func(sig os.Signal) {
		for r, c := range ranks {
			if running[r] {
				c.Process.Signal(sig)
			}
		}
	}
	var (
		order     []rankExit // exits in the order seen, failures first
		failed    bool
		forwarded os.Signal
		stage     int // after a failure: 0 grace, 1 SIGTERM sent, 2 SIGKILL sent
		timer     *time.Timer
		timeout   <-chan time.Time
	)
	for left := len(ranks); left > 0; {
		select {
		case e := <-exits:
			left--
			running[e.rank] = false
			order = append(order, e)
			if _, stopped := stoppedBy(e.state); !e.state.Success() && !stopped && !failed && forwarded == nil {
				failed = true
				fmt.Fprintf(o.Log, "launch: rank %d %s: stopping the other ranks (SIGTERM in %s, SIGKILL %s later)\n", e.rank, describeExit(e.state), o.Grace, o.Grace)
				timer = time.NewTimer(o.Grace)
				timeout = timer.C
			}
		case sig := <-o.Signals:
			if forwarded == nil {
				forwarded = sig
			}
			fmt.Fprintf(o.Log, "launch: %s: forwarding it to the ranks\n", cli.SignalName(sig))
			signalAll(sig)
		case <-timeout:
			stage++
			if stage == 1 {
				fmt.Fprintf(o.Log, "launch: ranks still running %s after the failure: SIGTERM\n", o.Grace)
				signalAll(syscall.SIGTERM)
				timer.Reset(o.Grace)
			} else {
				fmt.Fprintf(o.Log, "launch: ranks still running %s after SIGTERM: SIGKILL\n", o.Grace)
				signalAll(syscall.SIGKILL)
				timeout = nil
			}
		}
	}
	if timer != nil {
		timer.Stop()
	}
	var bad []rankExit
	for _, e := range order {
		if !e.state.Success() {
			bad = append(bad, e)
		}
	}
	if len(bad) == 0 {
		return nil
	}
	// The order the exits were seen in need not be the order of the
	// failures: a rank that died closes its sockets before its exit is
	// seen, and the others may end first. Their groups say whom they
	// blame: that rank leads.
	waited := make(chan struct{})
	go func() {
		reading.Wait() // every rank has exited: its pipe is at EOF
		close(waited)
	}()
	select {
	case <-waited:
	case <-time.After(o.Grace): // a rank's child holds its pipe
	}
	votes := make([]int, len(ranks))
	for counted := false; !counted; {
		select {
		case r := <-blames:
			votes[r]++
		default:
			counted = true
		}
	}
	sort.SliceStable(bad, func(i, j int) bool { return votes[bad[i].rank] > votes[bad[j].rank] })
	var b strings.Builder
	for i, e := range bad {
		if i == 1 {
			b.WriteString("; then ")
		} else if i > 1 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "rank %d %s", e.rank, describeExit(e.state))
	}
	if forwarded != nil && !failed {
		ss, _ := forwarded.(syscall.Signal)
		return &cli.Interrupted{Signal: ss, Msg: fmt.Sprintf("stopped by %s: %s", cli.SignalName(forwarded), b.String())}
	}
	if sig, ok := allStopped(bad); ok && !failed {
		return &cli.Interrupted{Signal: sig, Msg: fmt.Sprintf("stopped by %s sent to a rank: %s", cli.SignalName(sig), b.String())}
	}
	return &RankError{Rank: bad[0].rank, Msg: b.String()}
}

// stoppedBy reports whether a rank exited as a job a signal stopped after
// saving its progress does (cli.Interrupted: 128+SIGINT, 128+SIGTERM):
// SIGTERM sent to one rank stops every rank at one step, and with
// train.sigterm_exit_status 143 each exits so. That is no failure: the
// others are not to be stopped for it.
func stoppedBy(s *os.ProcessState) (syscall.Signal, bool) {
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		if s.ExitCode() == 128+int(sig) {
			return sig, true
		}
	}
	return 0, false
}

// allStopped reports whether every exit in bad is stoppedBy one signal.
func allStopped(bad []rankExit) (syscall.Signal, bool) {
	var first syscall.Signal
	for i, e := range bad {
		sig, ok := stoppedBy(e.state)
		if !ok || i > 0 && sig != first {
			return 0, false
		}
		first = sig
	}
	return first, len(bad) > 0
}

// describeExit is "exited with status 3" or "was killed by SIGKILL".
func describeExit(s *os.ProcessState) string {
	if ws, ok := s.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return "was killed by " + signalName(ws.Signal())
	}
	return fmt.Sprintf("exited with status %d", s.ExitCode())
}

func signalName(s syscall.Signal) string {
	switch s {
	case syscall.SIGINT, syscall.SIGTERM:
		return cli.SignalName(s)
	case syscall.SIGKILL:
		return "SIGKILL"
	case syscall.SIGSEGV:
		return "SIGSEGV"
	case syscall.SIGABRT:
		return "SIGABRT"
	case syscall.SIGBUS:
		return "SIGBUS"
	case syscall.SIGHUP:
		return "SIGHUP"
	}
	return fmt.Sprintf("signal %d (%v)", int(s), s)
}

func pids(cs []*exec.Cmd) string {
	s := make([]string, len(cs))
	for i, c := range cs {
		s[i] = strconv.Itoa(c.Process.Pid)
	}
	return strings.Join(s, ", ")
}

// withoutVars is env without the variables named.
func withoutVars(env, names []string) []string {
	out := make([]string, 0, len(env)+8)
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		drop := false
		for _, n := range names {
			drop = drop || k == n
		}
		if !drop {
			out = append(out, kv)
		}
	}
	return out
}

// lineWriter forwards whole lines to w with a prefix, holding a partial
// line until its end (or maxPartial bytes), so that the ranks' lines do
// not interleave mid-line. mu is shared by the writers of one w.
type lineWriter struct {
	w      io.Writer
	mu     *sync.Mutex
	prefix string
	buf    []byte
}

const maxPartial = 64 << 10

func (l *lineWriter) Write(p []byte) (int, error) {
	l.buf = append(l.buf, p...)
	var out []byte
	for {
		i := bytes.IndexByte(l.buf, '\n')
		if i < 0 {
			if len(l.buf) < maxPartial {
				break
			}
			i = len(l.buf) - 1 // a very long line goes out in pieces
			out = append(append(append(out, l.prefix...), l.buf[:i+1]...), '\n')
			l.buf = l.buf[:0]
			break
		}
		out = append(append(out, l.prefix...), l.buf[:i+1]...)
		l.buf = l.buf[i+1:]
	}
	l.buf = append([]byte(nil), l.buf...)
	if len(out) > 0 {
		l.mu.Lock()
		_, err := l.w.Write(out)
		l.mu.Unlock()
		if err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

// flush writes a last line without its newline.
func (l *lineWriter) flush() {
	if len(l.buf) > 0 {
		l.Write([]byte{'\n'})
	}
}
