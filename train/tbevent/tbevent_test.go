package tbevent

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// TestMaskedCRC: the CRC-32C check value of "123456789" is 0xE3069283
// (RFC 3720 B.4); the mask is TensorFlow's rotate-and-add.
func TestMaskedCRC(t *testing.T) {
	c := uint32(0xE3069283)
	want := ((c >> 15) | (c << 17)) + 0xa282ead8
	if got := MaskedCRC([]byte("123456789")); got != want {
		t.Fatalf("masked crc %#x, want %#x", got, want)
	}
}

func writeSample(t *testing.T) (string, []map[string]float64) {
	dir := t.TempDir()
	w, err := Create(dir)
	if err != nil {
		t.Fatal(err)
	}
	vals := []map[string]float64{
		{"train/loss": 3.25, "train/lr": 1e-3, "train/grad_norm": 0.5},
		{"train/loss": 2.5, "eval/top1_agreement": 0.125},
		{"train/loss": math.Inf(1)},
	}
	for i, v := range vals {
		if err := w.Scalars(int64(10*(i+1)), time.Unix(1700000000, 0), v); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return w.Path(), vals
}

// TestRoundTrip: the Go reader gets back every tag, value and step.
func TestRoundTrip(t *testing.T) {
	path, vals := writeSample(t)
	if !bytes.Contains([]byte(filepath.Base(path)), []byte("tfevents")) {
		t.Fatalf("name %s: TensorBoard only reads files with tfevents in the name", path)
	}
	evs, err := Read(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 4 || evs[0].FileVersion != "brain.Event:2" {
		t.Fatalf("events %+v", evs)
	}
	for i, v := range vals {
		ev := evs[i+1]
		if ev.Step != int64(10*(i+1)) || ev.WallTime != 1700000000 || len(ev.Scalars) != len(v) {
			t.Fatalf("event %d: %+v", i, ev)
		}
		for k, x := range v {
			if ev.Scalars[k] != float32(x) {
				t.Fatalf("event %d %s = %g, want %g", i, k, ev.Scalars[k], x)
			}
		}
	}
	// A flipped byte and a torn tail are both reported.
	b, _ := os.ReadFile(path)
	b[len(b)-7] ^= 1
	bad := filepath.Join(t.TempDir(), "events.out.tfevents.bad")
	os.WriteFile(bad, b, 0o644)
	if _, err := Read(bad); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("flipped byte: %v", err)
	}
	b[len(b)-7] ^= 1
	os.WriteFile(bad, b[:len(b)-3], 0o644)
	if _, err := Read(bad); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("torn tail: %v", err)
	}
}

// TestPythonReader decodes the file with testdata/read_events.py, an
// independent implementation of the documented format (its own CRC-32C and
// protobuf decoder), since TensorBoard itself is not installable here.
func TestPythonReader(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Fatal("python3 not found: run scripts/setup-test.sh (it installs python3 for this check)")
	}
	path, vals := writeSample(t)
	out, err := exec.Command(py, "testdata/read_events.py", path).CombinedOutput()
	if err != nil {
		t.Fatalf("read_events.py: %v\n%s", err, out)
	}
	type pyEvent struct {
		Step        int64          `json:"step"`
		FileVersion string         `json:"file_version"`
		WallTime    float64        `json:"wall_time"`
		Scalars     map[string]any `json:"scalars"`
	}
	var evs []pyEvent
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		var e pyEvent
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			t.Fatalf("%s: %v", sc.Bytes(), err)
		}
		evs = append(evs, e)
	}
	if len(evs) != 4 || evs[0].FileVersion != "brain.Event:2" {
		t.Fatalf("python saw %s", out)
	}
	for i, v := range vals[:2] {
		ev := evs[i+1]
		if ev.Step != int64(10*(i+1)) || ev.WallTime != 1700000000 {
			t.Fatalf("python event %d: %+v", i, ev)
		}
		for k, x := range v {
			if f, ok := ev.Scalars[k].(float64); !ok || float32(f) != float32(x) {
				t.Fatalf("python event %d %s = %v, want %g", i, k, ev.Scalars[k], x)
			}
		}
	}
	if evs[3].Scalars["train/loss"] != "inf" {
		t.Fatalf("python event 3: %+v, want train/loss inf", evs[3])
	}
}
