package inflight

import (
	"context"
	"testing"
)

func TestCounter(t *testing.T) {
	var c Counter
	if !c.Wait(t.Context()) {
		t.Fatal("Wait with nothing under way = false; want true at once")
	}
	c.Add()
	c.Add()
	ended, cancel := context.WithCancel(t.Context())
	cancel()
	if c.Wait(ended) {
		t.Fatal("Wait with two under way and its context ended = true; want false")
	}
	done := make(chan bool)
	go func() { done <- c.Wait(t.Context()) }()
	c.Done()
	c.Add() // starts while Wait runs: waited for too
	c.Done()
	select {
	case <-done:
		t.Fatal("Wait returned with one operation still under way")
	default:
	}
	c.Done()
	if !<-done {
		t.Fatal("Wait after every operation ended = false; want true")
	}
}
