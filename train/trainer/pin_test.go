package trainer

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strings"
	"testing"

	"distill/compute/cpu"
	"distill/train/tbevent"
)

var updatePinned = flag.Bool("update", false, "rewrite this machine's testdata/pinned/*.golden from this run (TestPinnedTrainer)")

// pinRun is one fixed training run of TestPinnedTrainer: its config and
// the paths of this test's temporary files, which the digests replace by
// their names (so that the digests do not depend on where t.TempDir is).
type pinRun struct {
	name  string
	cfg   *Config
	paths map[string]string // path -> placeholder
	// opts are the Options of each Run call in turn (a stop and a resume,
	// say); none: one call with the zero Options.
	opts []func() Options
	// nvfp4 also exports the final checkpoint as NVFP4 (QAD runs).
	nvfp4 bool
}

// timingFields are the metrics.jsonl fields that measure time or memory,
// which no two runs share.
var timingFields = regexp.MustCompile(`"(tokens_per_s|data_s|teacher_wait_s|queue_depth|gflop_per_s|peak_mem_bytes|wall_time)":[^,}]*,?`)

// timingLog is the timing part of a progress line, and the log lines that
// depend on timing (the dataset read-ahead's count: how far it had read
// when the run ended).
var (
	timingLog   = regexp.MustCompile(`\d+ tok/s [0-9.]+ GFLOP/s peak \d+ MiB eta \S+`)
	readAheadLn = regexp.MustCompile(`(?m)^dataset: tokenized .*\n`)
	loopback    = regexp.MustCompile(`127\.0\.0\.1:\d+`)
	// deviceAuto is the device chooser's line, which names what this
	// machine has (its driver's error, or its GPU): not the trainer's.
	deviceAuto = regexp.MustCompile(`(?m)^device auto: .*$`)
)

// pinDigests runs pr and returns a digest per output: the log and the
// Results (timings removed), metrics.jsonl (timing fields removed), the
// TensorBoard scalars (perf/ tags and wall times removed), config.yaml,
// every file of every checkpoint left, and every file of the exported
// model.
func pinDigests(t *testing.T, pr pinRun, texts map[string][]byte) map[string]string {
	t.Helper()
	out := map[string]string{}
	norm := func(b []byte) []byte {
		// Longest first: a run directory may lie inside another path.
		keys := make([]string, 0, len(pr.paths))
		for p := range pr.paths {
			keys = append(keys, p)
		}
		sort.Slice(keys, func(i, j int) bool { return len(keys[i]) > len(keys[j]) })
		for _, p := range keys {
			b = bytes.ReplaceAll(b, []byte(p), []byte(pr.paths[p]))
		}
		return loopback.ReplaceAll(b, []byte("ADDR"))
	}
	put := func(name string, b []byte) {
		out[pr.name+" "+name] = fmt.Sprintf("%x", sha256.Sum256(b))
	}
	// putText is put for an output a person can read: a mismatch shows
	// it, so that a failure on another machine says what changed.
	putText := func(name string, b []byte) {
		put(name, b)
		texts[pr.name+" "+name] = b
	}
	opts := pr.opts
	if len(opts) == 0 {
		opts = []func() Options{func() Options { return Options{} }}
	}
	var logs, results bytes.Buffer
	var last *Result
	for i, o := range opts {
		var log bytes.Buffer
		op := o()
		op.Log = &log
		res, err := Run(pr.cfg, op)
		fmt.Fprintf(&results, "call %d: error %v\n", i, err)
		if res != nil {
			describeResult(&results, res)
			last = res
		}
		logs.Write(log.Bytes())
	}
	l := timingLog.ReplaceAll(logs.Bytes(), []byte("TIMING"))
	l = deviceAuto.ReplaceAll(l, []byte("DEVICE"))
	putText("log", norm(readAheadLn.ReplaceAll(l, nil)))
	putText("results", norm(results.Bytes()))
	mj, err := os.ReadFile(filepath.Join(pr.cfg.RunDir, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	put("metrics.jsonl", timingFields.ReplaceAll(mj, nil))
	if pr.cfg.Log.TensorBoard {
		put("tb", tbDigest(t, pr.cfg.RunDir))
	}
	cy, err := os.ReadFile(filepath.Join(pr.cfg.RunDir, "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	putText("config.yaml", norm(cy))
	steps, err := listCheckpoints(pr.cfg.RunDir)
	if err != nil || len(steps) == 0 {
		t.Fatalf("%s: checkpoints %v: %v", pr.name, steps, err)
	}
	for _, s := range steps {
		dir := checkpointDir(pr.cfg.RunDir, s)
		for name, b := range dirFiles(t, dir) {
			put(filepath.Base(dir)+"/"+name, norm(b))
		}
	}
	formats := []string{"bf16"}
	if pr.nvfp4 {
		formats = append(formats, "nvfp4")
	}
	for _, f := range formats {
		exp := filepath.Join(t.TempDir(), "export-"+f)
		rep, err := Export(last.Checkpoint, exp, ExportOptions{Format: f})
		if err != nil {
			t.Fatalf("%s: export %s: %v", pr.name, f, err)
		}
		report := bytes.ReplaceAll([]byte(fmt.Sprintf("%+v", *rep)), []byte(exp), []byte("EXPORT"))
		put("export-"+f+"/report", norm(report))
		for name, b := range dirFiles(t, exp) {
			put("export-"+f+"/"+name, b)
		}
	}
	return out
}

// describeResult writes what a Result says, less the timings.
func describeResult(w *bytes.Buffer, r *Result) {
	fmt.Fprintf(w, "checkpoint %s resumed %s interrupted %v step %d\n", r.Checkpoint, r.Resumed, r.Interrupted, r.Step)
	for _, s := range r.Steps {
		s.TokensPerSec, s.DataSeconds, s.TeacherWaitSeconds, s.QueueDepth, s.GFLOPs, s.PeakMemBytes, s.WallTime = 0, 0, 0, 0, 0, 0, 0
		fmt.Fprintf(w, "step %+v\n", s)
		fmt.Fprintf(w, "  bits %x %x %x %x\n", math.Float64bits(s.Loss), math.Float64bits(s.KD), math.Float64bits(s.CE), math.Float64bits(s.GradNorm))
	}
	for _, e := range r.Evals {
		fmt.Fprintf(w, "eval %+v\n", e)
		fmt.Fprintf(w, "  bits %x %x %x\n", math.Float64bits(e.Loss), math.Float64bits(e.KD), math.Float64bits(e.CE))
	}
}

// dirFiles reads every file of dir (not recursively).
func dirFiles(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]byte{}
	for _, e := range ents {
		if e.IsDir() {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		out[e.Name()] = b
	}
	return out
}

// tbDigest is the content of a run's TensorBoard events less what
// measures time: steps, session starts, and every scalar but perf/*.
func tbDigest(t *testing.T, runDir string) []byte {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join(runDir, "tb", "events.out.tfevents.*"))
	sort.Strings(files)
	var b bytes.Buffer
	for _, f := range files {
		evs, err := tbevent.Read(f)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&b, "file\n")
		for _, ev := range evs {
			fmt.Fprintf(&b, "step %d version %q start %v\n", ev.Step, ev.FileVersion, ev.SessionStart)
			tags := make([]string, 0, len(ev.Scalars))
			for tag := range ev.Scalars {
				if !strings.HasPrefix(tag, "perf/") {
					tags = append(tags, tag)
				}
			}
			sort.Strings(tags)
			for _, tag := range tags {
				fmt.Fprintf(&b, "  %s ", tag)
				binary.Write(&b, binary.LittleEndian, math.Float32bits(ev.Scalars[tag]))
				b.WriteByte('\n')
			}
		}
	}
	return b.Bytes()
}

// pinMachine names what the pinned bits depend on besides the code: the
// kernels OpenBLAS runs, the CPU, the architecture. The digests of one
// machine are compared only on a machine of the same name.
func pinMachine() string {
	model := "unknown-cpu"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(bytes.NewReader(b))
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "model name"); ok {
				model = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(v), ":"))
				break
			}
		}
	}
	name := runtime.GOARCH + "-" + cpu.BLASCore() + "-" + model
	return regexp.MustCompile(`[^A-Za-z0-9._-]+`).ReplaceAllString(name, "_")
}

// pinRuns are the fixed runs: KD from one cache (straight, stopped by a
// crash and resumed, interrupted mid-step and resumed), NVFP4 QAD, an MoE
// student, two teachers' caches, SFT from a dataset, and online KD from
// one and from two live teachers.
func pinRuns(t *testing.T) []pinRun {
	b := testCache(t)
	dir := func(name string) string { return filepath.Join(t.TempDir(), name) }
	cachePaths := func(run string) map[string]string {
		return map[string]string{run: "RUN", b.CacheDir: "CACHE"}
	}
	var runs []pinRun
	rd := dir("cache")
	runs = append(runs, pinRun{name: "cache", cfg: tinyConfig(t, b, rd), paths: cachePaths(rd)})
	rd = dir("cache-resume")
	runs = append(runs, pinRun{name: "cache-resume", cfg: tinyConfig(t, b, rd), paths: cachePaths(rd), opts: []func() Options{
		func() Options { return Options{StopAfter: 6} },
		func() Options { return Options{} },
	}})
	rd = dir("cache-interrupt")
	runs = append(runs, pinRun{name: "cache-interrupt", cfg: tinyConfig(t, b, rd), paths: cachePaths(rd), opts: []func() Options{
		func() Options {
			stop := make(chan struct{})
			testHookRow = func(step, row int) {
				if step == 7 && row == 1 {
					close(stop)
					testHookRow = nil
				}
			}
			return Options{Stop: stop}
		},
		func() Options { return Options{} },
	}})
	rd = dir("qad")
	runs = append(runs, pinRun{name: "qad", cfg: tinyConfig(t, b, rd, "quant=nvfp4", "calib_batches=2", "train.max_steps=6"), paths: cachePaths(rd), nvfp4: true})
	rd = dir("moe")
	runs = append(runs, pinRun{name: "moe", cfg: moeConfig(t, b, rd), paths: cachePaths(rd)})

	ca := mtCache(t, teacherSpec{teacher: 0, k: 8, chunk: 16})
	cb := mtCache(t, teacherSpec{teacher: 1, k: 5, chunk: 8})
	rd = dir("caches")
	runs = append(runs, pinRun{name: "caches", cfg: mtConfig(t, rd, fmt.Sprintf("[{dir: %s, name: a, weight: 0.7}, {dir: %s, name: b, weight: 0.3}]", ca, cb)),
		paths: map[string]string{rd: "RUN", ca: "CACHE_A", cb: "CACHE_B"}})

	tokDir, file := byteDataset(t, 80)
	rd = dir("dataset")
	runs = append(runs, pinRun{name: "dataset", cfg: sftConfig(t, tokDir, file, rd), paths: map[string]string{rd: "RUN", tokDir: "TOK", file: "DATA"}})

	f := newOnlineFixture(t, 40)
	ta := startTeacherd(t, f.teacher, f.tokDir, "", "")
	tb := startTeacherd(t, teacherModel(t, 64, 1), f.tokDir, "", "")
	onPaths := func(run string) map[string]string {
		return map[string]string{run: "RUN", f.tokDir: "TOK", f.file: "DATA"}
	}
	rd = dir("online")
	runs = append(runs, pinRun{name: "online", cfg: onlineConfig(t, f.tokDir, f.file, rd, "", []string{ta.addr()}, "log.tensorboard=true"), paths: onPaths(rd)})
	rd = dir("online-multi")
	runs = append(runs, pinRun{name: "online-multi", cfg: onlineConfig(t, f.tokDir, f.file, rd, "", []string{ta.addr()}, teachersOver(ta.addr(), tb.addr(), 0.7, 0.3)), paths: onPaths(rd)})
	return runs
}

// TestPinnedTrainer: fixed training runs over every source (one cache,
// several caches, a dataset, live teachers), with a crash and resume, an
// interrupt and resume, QAD and an MoE student, write the same bytes as
// the trainer did before it was split into components (issue 24): the
// log and the Results less their timings, metrics.jsonl less its timing
// fields, the TensorBoard scalars, config.yaml, every checkpoint file and
// the exported model. The bits depend on the machine's kernels, so the
// digests are kept per machine (testdata/pinned/MACHINE.golden); on a
// machine with none the test says so and skips. `go test ./train/trainer
// -run TestPinnedTrainer -update` writes this machine's from the code as
// it is: run it on code known to be right, before a change.
func TestPinnedTrainer(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the pinned runs train nine tiny students")
	}
	golden := filepath.Join("testdata", "pinned", pinMachine()+".golden")
	want, err := os.ReadFile(golden)
	if err != nil && !*updatePinned {
		t.Skipf("no pinned outputs for this machine (%v): `go test ./train/trainer -run TestPinnedTrainer -update` on code known to be right writes them", err)
	}
	got, texts := map[string]string{}, map[string][]byte{}
	for _, pr := range pinRuns(t) {
		for k, v := range pinDigests(t, pr, texts) {
			got[k] = v
		}
	}
	keys := make([]string, 0, len(got))
	for k := range got {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%s sha256:%s\n", k, got[k])
	}
	if *updatePinned {
		os.MkdirAll(filepath.Dir(golden), 0o755)
		if err := os.WriteFile(golden, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	// Each output by name: a change names the file and the run.
	pinned := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(want)), "\n") {
		if k, v, ok := strings.Cut(line, " sha256:"); ok {
			pinned[k] = v
		}
	}
	for _, k := range keys {
		if w, ok := pinned[k]; !ok {
			t.Errorf("%s: not pinned in %s", k, golden)
		} else if w != got[k] {
			t.Errorf("%s: sha256 %.16s, pinned %.16s: the output changed", k, got[k], w)
			if txt, ok := texts[k]; ok {
				t.Logf("%s as this run wrote it (normalized):\n%s", k, txt)
			}
		}
		delete(pinned, k)
	}
	for k := range pinned {
		t.Errorf("%s: pinned in %s, not written by this run", k, golden)
	}
}
