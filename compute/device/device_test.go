package device

import (
	"errors"
	"strings"
	"testing"
)

func TestOpen(t *testing.T) {
	for _, name := range []string{"", "auto", "cpu"} {
		be, err := Open(name, 2)
		if err != nil || be.Name() != "cpu" {
			t.Fatalf("Open(%q): %v %v", name, be, err)
		}
	}
	if _, err := Open("cuda", 0); !errors.Is(err, ErrDevice) || !strings.Contains(err.Error(), "no CUDA backend") {
		t.Fatalf("cuda: %v", err)
	}
	if _, err := Open("tpu", 0); !errors.Is(err, ErrDevice) || !strings.Contains(err.Error(), `"tpu"`) {
		t.Fatalf("tpu: %v", err)
	}
	for _, name := range []string{"", "auto", "cpu"} {
		if err := Check(name); err != nil {
			t.Fatalf("Check(%q): %v", name, err)
		}
	}
	if err := Check("cuda"); !errors.Is(err, ErrDevice) || !strings.Contains(err.Error(), "no CUDA backend") {
		t.Fatalf("Check(cuda): %v", err)
	}
	if _, err := Open("cpu", -1); !errors.Is(err, ErrDevice) {
		t.Fatalf("threads -1: %v", err)
	}
}
