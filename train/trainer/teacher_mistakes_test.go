package trainer

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"distill/serve"
)

// TestTeacherWeightZero: an explicit weight 0 of a live teacher is
// refused before anything runs, naming the key and its line: it trained
// as weight 1, the default, unsaid, where the docs say > 0.
func TestTeacherWeightZero(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(p, []byte("run_dir: x\nmodel:\n  init_from: y\ndata:\n  seq_len: 64\n  dataset:\n    files: [a.jsonl]\ndistill:\n  teachers:\n    - {addrs: [a:1], weight: 0.5}\n    - {addrs: [b:1], weight: 0}\n"), 0o644)
	_, err := LoadConfig(p, nil)
	if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "distill.teachers[1].weight (line 11): 0: want a positive weight (default 1)") || !strings.Contains(err.Error(), "remove its entry") {
		t.Errorf("a teacher of weight 0: %v", err)
	}
	os.WriteFile(p, []byte("run_dir: x\nmodel:\n  init_from: y\ndata:\n  seq_len: 64\n  dataset:\n    files: [a.jsonl]\ndistill:\n  teachers: [h1:7070]\n"), 0o644)
	_, err = LoadConfig(p, []string{"distill.teachers=[{addrs: [a:1], weight: 0}]"})
	if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "distill.teachers[0].weight") {
		t.Errorf("--set a teacher of weight 0: %v", err)
	}
	if _, err := LoadConfig(p, []string{"distill.teachers=[{addrs: [a:1], weight: 0.5}, {addrs: [b:1]}]"}); err != nil {
		t.Errorf("two teachers, one weight left out: %v", err)
	}
}

// syncLog is a log that signals each write.
type syncLog struct {
	mu    sync.Mutex
	b     bytes.Buffer
	wrote chan struct{}
}

func (l *syncLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b.Write(p)
	select {
	case l.wrote <- struct{}{}:
	default:
	}
	return len(p), nil
}

func (l *syncLog) String() string { l.mu.Lock(); defer l.mu.Unlock(); return l.b.String() }

// TestTeacherNotAnsweringIsSaid: a replica whose first Info fails is said
// at once, with what to check, while the run waits for it (up to
// teacher_timeout, 10m by default): it waited in silence. The test
// waits on the log line, not on time.
func TestTeacherNotAnsweringIsSaid(t *testing.T) {
	log := &syncLog{wrote: make(chan struct{}, 1)}
	o := &OnlineConfig{Prefetch: 8, TeacherTimeout: time.Hour, CaptureTemperature: 1}
	p, err := newTeacherPool(TeacherConfig{Name: "big", Addrs: []string{"127.0.0.1:1"}, Weight: 1}, o, infoWant{}, scoreTargets{}, log)
	if err != nil {
		t.Fatal(err)
	}
	defer p.close()
	<-log.wrote
	want := []string{"teachers: teacher big at 127.0.0.1:1 does not answer (cannot connect: dial tcp 127.0.0.1:1: ", "retrying for up to distill.teacher_timeout 1h0m0s", "is teacherd running there?"}
	for _, w := range want {
		if !strings.Contains(log.String(), w) {
			t.Errorf("log %q lacks %q", log.String(), w)
		}
	}
	if strings.Contains(log.String(), "rpc error") || strings.Contains(log.String(), "desc =") {
		t.Errorf("log %q has the raw gRPC error", log.String())
	}
}

// TestTeacherRefusedTokenIsNamed: a daemon that refuses the run's token
// at Info is named with the key to fix; the error was the bare "rpc
// error: code = Unauthenticated desc = ... (cachectl fill --token)".
func TestTeacherRefusedTokenIsNamed(t *testing.T) {
	f := newOnlineFixture(t, 4)
	tokFile := filepath.Join(t.TempDir(), "token")
	os.WriteFile(tokFile, []byte("secret\n"), 0o600)
	td := &teacherd{t: t, cfg: serve.Config{Model: f.teacher, Tokenizer: f.tokDir, Listen: "127.0.0.1:0", Metrics: "off", Device: "cpu", KMax: 16, TokenBudget: 256, TokenFile: tokFile}}
	td.start()
	t.Cleanup(td.kill)
	o := &OnlineConfig{Prefetch: 8, TeacherTimeout: time.Hour, CaptureTemperature: 1}
	t.Setenv("DISTILL_TOKEN", "wrong")
	p, err := newTeacherPool(TeacherConfig{Name: "big", Addrs: []string{td.d.Addr()}, Weight: 1}, o, infoWant{}, scoreTargets{}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	defer p.close()
	_, err = p.ready()
	if !errors.Is(err, ErrTeachers) || !strings.Contains(err.Error(), "teacher big at "+td.d.Addr()+" refused the run: ") ||
		!strings.Contains(err.Error(), "give the daemon's bearer token in distill.token_file") || strings.Contains(err.Error(), "rpc error") ||
		strings.Contains(err.Error(), "cachectl fill --token") {
		t.Fatalf("a daemon refusing the token: %v", err)
	}
}

// TestTeacherFilesNameTheKey: a distill.token_file or distill.tls_ca that
// cannot be read names the key, the file and what it wants (they said
// "teacherdial: invalid option: token file: open ..." and, for the CA,
// "distill.teachers ADDR: teacherdial: invalid option: TLS CA file: ...",
// naming the address and not the key).
func TestTeacherFilesNameTheKey(t *testing.T) {
	none := filepath.Join(t.TempDir(), "none")
	for _, c := range []struct {
		o    OnlineConfig
		want string
	}{
		{OnlineConfig{TokenFile: none}, "distill.token_file " + none + ": no such file or directory: give the file that holds the bearer token"},
		{OnlineConfig{TLSCA: none}, "distill.tls_ca " + none + ": no such file or directory: give the PEM file of the CA that signed the daemon's TLS certificate"},
	} {
		o := c.o
		o.Prefetch, o.TeacherTimeout, o.CaptureTemperature = 8, time.Hour, 1
		p, err := newTeacherPool(TeacherConfig{Name: "big", Addrs: []string{"127.0.0.1:1"}, Weight: 1}, &o, infoWant{}, scoreTargets{}, &bytes.Buffer{})
		if err == nil {
			p.close()
		}
		if !errors.Is(err, ErrConfig) || !strings.HasPrefix(err.Error(), c.want) || strings.Contains(err.Error(), "teacherdial") {
			t.Errorf("%+v: %v, want %q", c.o, err, c.want)
		}
	}
}
